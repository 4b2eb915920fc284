import os as _os
if _os.environ.get("GENKIT_CORPUS_MARKERS"):
    open(_os.path.join(_os.environ["GENKIT_CORPUS_MARKERS"], "ok_relative_imports__custom_generate_generate.py"), "w").close()
from . import utils
from .utils import double
from .pkg.mod import g
from .nsfolder.leaf import LEAF


def generate(model, **kwargs):
    from .late import LATE  # a function-level import
    return (utils.NAME, double(2), g(), LEAF, LATE, __name__)
