import os as _os
if _os.environ.get("GENKIT_CORPUS_MARKERS"):
    open(_os.path.join(_os.environ["GENKIT_CORPUS_MARKERS"], "ok_twin_b__custom_generate_generate.py"), "w").close()
from .utils import WHO


def generate(model, **kwargs):
    return WHO
