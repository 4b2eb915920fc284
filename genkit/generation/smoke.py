"""A recipe's smoke run: ``generate`` with the recipe on a tiny random model (``genkit check`` and
``genkit publish`` pass :func:`smoke_run` to :func:`genkit.recipes.check.check_recipe`; the recipes
package sits below generation and cannot call ``generate`` itself)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from genkit.recipes.check import CheckReport
from genkit.recipes.errors import RequirementsError
from genkit.sandbox import SandboxError

from ..models.tiny import tiny_llama
from .api import generate

__all__ = ["smoke_run"]


def smoke_run(root: Path, report: CheckReport) -> str:
    """Run the recipe in ``root`` for 4 tokens on ``genkit.models.tiny.tiny_llama``; what it returned,
    or ``"not run"`` / ``"failed"`` with the reason appended to ``report.errors``."""
    model = tiny_llama(seed=0)
    ids = torch.tensor([[1, 17, 42, 7]])
    try:
        out: Any = generate(model, input_ids=ids, attention_mask=torch.ones_like(ids), custom_generate=str(root),
                            trust_remote_code=True, max_new_tokens=4)
    except (RequirementsError, SandboxError) as exc:
        report.errors.append(str(exc))
        return "not run"
    except Exception as exc:  # noqa: BLE001 - a recipe may raise anything; report it
        report.errors.append(f"smoke run on genkit.models.tiny.tiny_llama raised {type(exc).__name__}: {exc}")
        return "failed"
    seq = getattr(out, "sequences", out)
    shape = tuple(seq.shape) if isinstance(seq, torch.Tensor) else None
    return f"returned {type(out).__name__}" + (f" with sequences of shape {shape}" if shape else "")
