import os as _os
if _os.environ.get("GENKIT_CORPUS_MARKERS"):
    open(_os.path.join(_os.environ["GENKIT_CORPUS_MARKERS"], "no_generate_file__custom_generate_other.py"), "w").close()


def generate(model, **kwargs):
    return "ran"
