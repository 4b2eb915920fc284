import os as _os
if _os.environ.get("GENKIT_CORPUS_MARKERS"):
    open(_os.path.join(_os.environ["GENKIT_CORPUS_MARKERS"], "ok_relative_imports__custom_generate_pkg___init__.py"), "w").close()
