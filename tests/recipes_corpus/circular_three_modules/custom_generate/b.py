import os as _os
if _os.environ.get("GENKIT_CORPUS_MARKERS"):
    open(_os.path.join(_os.environ["GENKIT_CORPUS_MARKERS"], "circular_three_modules__custom_generate_b.py"), "w").close()
from .c import C
B = 1
