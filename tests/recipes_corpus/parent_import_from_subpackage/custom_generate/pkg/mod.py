import os as _os
if _os.environ.get("GENKIT_CORPUS_MARKERS"):
    open(_os.path.join(_os.environ["GENKIT_CORPUS_MARKERS"], "parent_import_from_subpackage__custom_generate_pkg_mod.py"), "w").close()
from ...outside import y

def g():
    return y
