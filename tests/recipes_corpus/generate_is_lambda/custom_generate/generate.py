import os as _os
if _os.environ.get("GENKIT_CORPUS_MARKERS"):
    open(_os.path.join(_os.environ["GENKIT_CORPUS_MARKERS"], "generate_is_lambda__custom_generate_generate.py"), "w").close()


generate = lambda model: 1  # noqa: E731
