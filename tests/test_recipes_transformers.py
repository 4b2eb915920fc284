"""The same recipe folder runs under transformers' own custom_generate loader and under genkit,
and gives the same tokens on the same weights (the layout and calling convention are shared)."""

from __future__ import annotations

import torch
from hub_server import write_recipe

import genkit

LOOP = '''
import torch

from .pick import pick


def generate(model, inputs=None, input_ids=None, steps=5, **kwargs):
    """A plain greedy loop on the shared model API: model(input_ids).logits, no cache."""
    ids = inputs if inputs is not None else input_ids
    for _ in range(steps):
        logits = model(ids).logits[:, -1, :]
        ids = torch.cat([ids, pick(logits)], dim=-1)
    return ids
'''


def test_one_recipe_two_libraries_same_tokens(tiny_pair, tmp_path):
    hf, ours = tiny_pair
    root = write_recipe(tmp_path / "shared", {
        "custom_generate/generate.py": LOOP,
        "custom_generate/pick.py": "def pick(logits):\n    return logits.argmax(-1, keepdim=True)\n"})
    ids = torch.tensor([[1, 17, 42, 7], [1, 99, 3, 64]])
    reference = hf.generate(ids, custom_generate=str(root), trust_remote_code=True, steps=6)
    ours_out = genkit.generate(ours, ids, custom_generate=str(root), steps=6)
    assert reference.shape == (2, 10)
    assert torch.equal(ours_out, reference)
    # and the loop agrees with genkit's built-in greedy decoding
    assert torch.equal(ours_out, genkit.generate(ours, ids, max_new_tokens=6, do_sample=False))


CLASH = '''
import json
import random

from .random import pick


def generate(model, inputs=None, input_ids=None, **kwargs):
    """`import random` / `import json` are the standard library's, though the recipe has a random.py and a json.py."""
    return [random.__name__, json.dumps(pick()), json.__name__]
'''


def test_helpers_named_like_installed_modules_run_as_in_transformers(tiny_pair, tmp_path):
    hf, ours = tiny_pair
    root = write_recipe(tmp_path / "clash", {
        "custom_generate/generate.py": CLASH,
        "custom_generate/random.py": "def pick():\n    return 4\n",
        "custom_generate/json.py": "raise RuntimeError('the recipe json.py is never imported')\n",
        "torch.py": "raise RuntimeError('a file next to custom_generate/ is never imported')\n"})
    reference = hf.generate(torch.tensor([[1, 2]]), custom_generate=str(root), trust_remote_code=True)
    assert reference == ["random", "4", "json"]
    assert genkit.generate(ours, torch.tensor([[1, 2]]), custom_generate=str(root)) == reference


def test_an_absolute_import_of_an_own_module_that_is_not_installed_is_still_refused(tmp_path):
    import pytest

    from genkit.recipes import RecipeValidationError, load_recipe

    root = write_recipe(tmp_path / "own", {"custom_generate/generate.py": "import genkit_no_such_helper\n"
                                           "def generate(model, **kw):\n    return 1\n",
                                           "custom_generate/genkit_no_such_helper.py": "X = 1\n"})
    with pytest.raises(RecipeValidationError, match="generate.py:1: absolute import of the recipe's own module "
                                                    "`genkit_no_such_helper`; write a relative import"):
        load_recipe(str(root))
