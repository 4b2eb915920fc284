import os as _os
if _os.environ.get("GENKIT_CORPUS_MARKERS"):
    open(_os.path.join(_os.environ["GENKIT_CORPUS_MARKERS"], "circular_imports__custom_generate_helper.py"), "w").close()
from .generate import generate

def h():
    return 1
