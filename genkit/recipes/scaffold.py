"""``genkit new NAME``: a recipe folder that passes ``genkit check`` out of the box."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import ConfigError

NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")

GENERATE = '''"""{title}: describe what this decoding recipe does differently from plain generate()."""

from __future__ import annotations

from typing import Any

import genkit


def generate(model: Any, inputs: Any = None, *, repetition_window: int = 8, **kwargs: Any) -> Any:
    """Greedy or sampled decoding that forbids repeating any of the last ``repetition_window`` tokens.

    Every other argument (``input_ids``, ``attention_mask``, ``max_new_tokens``, ``streamer``, ...)
    is passed on to ``genkit.generate``.
    """
    if not isinstance(repetition_window, int) or repetition_window < 0:
        raise ValueError(f"`repetition_window` must be a non-negative integer; got {{repetition_window!r}}")
    processors = list(kwargs.pop("logits_processor", None) or [])
    processors.append(NoRecentRepeat(repetition_window))
    return genkit.generate(model, inputs, logits_processor=processors, **kwargs)


class NoRecentRepeat:
    """Set the score of every token among the last ``window`` ones to -inf."""

    def __init__(self, window: int) -> None:
        self.window = window

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        if self.window == 0:
            return scores
        recent = input_ids[:, -self.window:]
        return scores.scatter(1, recent, float("-inf"))
'''

README = """---
library_name: genkit
tags:
  - custom_generate
---

# {title}

One paragraph: what this recipe changes about decoding and when it helps.

```python
import genkit
out = genkit.generate(model, **inputs, custom_generate="ORG/{name}", trust_remote_code=True,
                      repetition_window=8, max_new_tokens=40)
```

## Arguments

- `repetition_window` (int, default 8): how many of the most recent tokens may not be repeated.
- Every other `generate` argument is passed through unchanged.

## Output differences

None: returns what `genkit.generate` returns (token ids, or an output object with
`return_dict_in_generate=True`).
"""

REQUIREMENTS = """# PEP 508 lines, checked before the recipe is imported; no URLs or pip options.
torch>=2.2
"""

TEST = '''"""Run with: python -m pytest tests/ (from the recipe folder)."""

from pathlib import Path

import torch

import genkit
from genkit.models.tiny import tiny_llama

RECIPE = str(Path(__file__).resolve().parents[1])


def test_recipe_runs_and_avoids_recent_repeats():
    model = tiny_llama(seed=0)
    ids = torch.tensor([[1, 17, 42, 7]])
    out = genkit.generate(model, input_ids=ids, custom_generate=RECIPE, max_new_tokens=6, repetition_window=4)
    assert out.shape == (1, 10)
    new = out[0, 4:].tolist()
    for i, token in enumerate(new):
        assert token not in out[0, max(0, 4 + i - 4):4 + i].tolist()
'''


def new_recipe(name: str, parent: str | os.PathLike[str] = ".", *, force: bool = False) -> Path:
    """Create ``parent/name`` with custom_generate/generate.py, requirements.txt, README.md and a test."""
    if not NAME_RE.fullmatch(name or ""):
        raise ConfigError(f"recipe name {name!r} must start with a letter and use only letters, digits, '-' and '_' "
                          "(at most 64 characters)")
    root = Path(parent) / name
    if root.exists() and not force and any(root.iterdir()):
        raise FileExistsError(f"{root} already exists and is not empty; pick another name or pass --force")
    title = name.replace("-", " ").replace("_", " ").strip().capitalize()
    files = {
        "custom_generate/generate.py": GENERATE.format(title=title),
        "custom_generate/requirements.txt": REQUIREMENTS,
        "README.md": README.format(title=title, name=name),
        "tests/test_recipe.py": TEST,
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root
