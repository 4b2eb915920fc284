import os as _os
if _os.environ.get("GENKIT_CORPUS_MARKERS"):
    open(_os.path.join(_os.environ["GENKIT_CORPUS_MARKERS"], "absolute_self_import__custom_generate_utils.py"), "w").close()
X = 1
