"""``load_model``: native models from a local HF-format folder (Hub ids and GGUF: see below)."""

from __future__ import annotations

import os
from typing import Any

import torch

from .base import GenkitModel, ModelConfig

ARCHITECTURES = {"LlamaForCausalLM": "genkit.models.llama:LlamaForCausalLM",
                 "MistralForCausalLM": "genkit.models.llama:LlamaForCausalLM",
                 "Qwen2ForCausalLM": "genkit.models.llama:LlamaForCausalLM"}


def load_model(ref: str | os.PathLike[str], revision: str | None = None, dtype: torch.dtype | str | None = None,
               device: str | torch.device | None = None, trust_remote_code: bool | None = None) -> GenkitModel:
    """Load a native model from a local folder holding config.json and model.safetensors."""
    from safetensors.torch import load_file

    from ..plugins import resolve

    folder = os.fspath(ref)
    config = ModelConfig.from_json_file(os.path.join(folder, "config.json"))
    arch = (config.architectures or ["LlamaForCausalLM"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
    cls = resolve(ARCHITECTURES[arch])
    model = cls(config)
    state = load_file(os.path.join(folder, "model.safetensors"))
    model.load_state_dict(state, strict=False)
    gen_path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(gen_path):
        from ..config import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder)
    if dtype is not None:
        model = model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    if device is not None:
        model = model.to(device)
    return model.eval()
