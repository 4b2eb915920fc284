import os as _os
if _os.environ.get("GENKIT_CORPUS_MARKERS"):
    open(_os.path.join(_os.environ["GENKIT_CORPUS_MARKERS"], "parent_import_from_subpackage__custom_generate_generate.py"), "w").close()
from .pkg.mod import g


def generate(model, **kwargs):
    return "ran"
