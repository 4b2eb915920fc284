import os as _os
if _os.environ.get("GENKIT_CORPUS_MARKERS"):
    open(_os.path.join(_os.environ["GENKIT_CORPUS_MARKERS"], "circular_three_modules__custom_generate_generate.py"), "w").close()
from .a import A


def generate(model, **kwargs):
    return "ran"
