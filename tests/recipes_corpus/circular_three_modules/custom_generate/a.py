import os as _os
if _os.environ.get("GENKIT_CORPUS_MARKERS"):
    open(_os.path.join(_os.environ["GENKIT_CORPUS_MARKERS"], "circular_three_modules__custom_generate_a.py"), "w").close()
from .b import B
A = 1
