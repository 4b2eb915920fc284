import os as _os
if _os.environ.get("GENKIT_CORPUS_MARKERS"):
    open(_os.path.join(_os.environ["GENKIT_CORPUS_MARKERS"], "wrong_first_parameter__custom_generate_generate.py"), "w").close()


def generate(input_ids, model=None):
    return 1
