import os as _os
if _os.environ.get("GENKIT_CORPUS_MARKERS"):
    open(_os.path.join(_os.environ["GENKIT_CORPUS_MARKERS"], "ok_relative_imports__custom_generate_utils.py"), "w").close()
NAME = 'ok_relative_imports'


def double(x):
    return 2 * x
