import os as _os
if _os.environ.get("GENKIT_CORPUS_MARKERS"):
    open(_os.path.join(_os.environ["GENKIT_CORPUS_MARKERS"], "helper_raises_on_import__custom_generate_utils.py"), "w").close()
def f():
    return 1


raise ValueError('helper exploded')
