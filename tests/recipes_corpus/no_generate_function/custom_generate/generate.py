import os as _os
if _os.environ.get("GENKIT_CORPUS_MARKERS"):
    open(_os.path.join(_os.environ["GENKIT_CORPUS_MARKERS"], "no_generate_function__custom_generate_generate.py"), "w").close()


def run(model):
    return 1
