import os as _os
if _os.environ.get("GENKIT_CORPUS_MARKERS"):
    open(_os.path.join(_os.environ["GENKIT_CORPUS_MARKERS"], "requirements_unmet__custom_generate_generate.py"), "w").close()


def generate(model, **kwargs):
    return "ran"
