"""transformers' ``PreTrainedModel`` API on native models, without transformers.

:class:`PreTrainedAPI` is mixed into :class:`genkit.models.base.GenkitModel`: ``save_pretrained``
(``config.json``, ``generation_config.json``, ``model.safetensors``: a folder transformers'
``from_pretrained`` and :func:`genkit.load_model` both read), ``push_to_hub``, the class methods
``from_pretrained`` and ``_from_config``, ``num_parameters``, ``can_generate``,
``main_input_name`` and the class flags transformers reads before it generates, each set to what
genkit's models do (see docs/api.md, "transformers' model API").
"""

from __future__ import annotations

import inspect
import logging
import os
import tempfile
from typing import Any

import torch

from ..errors import ConfigError, NotSupportedError

logger = logging.getLogger("genkit.models")

#: the attention implementations native models run (transformers' names)
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


class PreTrainedAPI:
    """The parts of transformers' ``PreTrainedModel`` that code written for transformers reads."""

    #: the name of the forward's main input
    main_input_name = "input_ids"
    #: no recurrent state outside the cache: generation can be restarted, beams reordered, ...
    _is_stateful = False
    #: attention is torch's scaled_dot_product_attention (eager when ``output_attentions=True``)
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flash_attn_2 = False
    _supports_flex_attn = False
    _supports_attention_backend = False
    #: the forward also takes a transformers ``Cache`` (``DynamicCache``) as ``past_key_values``
    _supports_cache_class = True
    _supports_static_cache = False
    _supports_quantized_cache = False
    #: the cache grows in Python and the inference path edits weights in place: no full-graph compile
    _can_compile_fullgraph = False
    supports_gradient_checkpointing = False
    #: how attention is computed: "sdpa" (torch's scaled_dot_product_attention, the inference path) or
    #: "eager" (step by step, as transformers' eager implementation: the module path, slower; for
    #: comparisons); set with :meth:`set_attn_implementation` or ``attn_implementation=`` when loading
    attn_implementation = "sdpa"
    #: whether the LM head shares the input embedding when the config leaves `tie_word_embeddings` out
    ties_embeddings_by_default = False

    def set_attn_implementation(self, attn_implementation: str) -> None:
        """Compute attention with ``"sdpa"`` or ``"eager"`` (transformers' method of that name)."""
        if attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise NotSupportedError(f"`attn_implementation`={attn_implementation!r} is not supported; accepted: "
                                    f"{', '.join(repr(a) for a in ATTN_IMPLEMENTATIONS)}")
        decoder = getattr(self, "decoder", None)
        if attn_implementation == "eager" and "attentions" not in inspect.signature(decoder).parameters:
            raise NotSupportedError(f"`attn_implementation`='eager' is not supported by {type(self).__name__}: its "
                                    "layers compute attention one way only")
        self.attn_implementation = attn_implementation

    @property
    def name_or_path(self) -> str:
        """Where the model was loaded from ("" for one built in memory), transformers' attribute."""
        return getattr(self, "config").name_or_path or ""

    @classmethod
    def can_generate(cls) -> bool:
        """Native models are causal LMs: always True."""
        return True

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """The number of parameters (a tied weight counted once); ``only_trainable``: those that
        require grad; ``exclude_embeddings``: without the token (and position) embedding tables."""
        assert isinstance(self, torch.nn.Module)
        skip = set()
        if exclude_embeddings:
            skip = {id(m.weight) for m in self.modules() if isinstance(m, torch.nn.Embedding)}
        floats = sum(p.numel() for p in self.parameters() if id(p) not in skip and (p.requires_grad or not only_trainable))
        return floats if only_trainable else floats + self._quantized_weights(exclude_embeddings)

    def _quantized_weights(self, exclude_embeddings: bool) -> int:
        """The values of the weights held quantized (buffers, not parameters: a GGUF's int4/int8
        matrices, embedding and biases), counted as the matrices they stand for, as transformers
        counts the GGUF it de-quantizes; a head tied to the embedding once (as the embedding)."""
        from .quant import Int4Linear, QuantizedEmbedding, WithBias

        assert isinstance(self, torch.nn.Module)
        head = getattr(self, "get_output_embeddings")()
        tied = bool(getattr(self, "config").get("tie_word_embeddings", self.ties_embeddings_by_default))
        tied_head = {id(head), id(getattr(head, "inner", None))} if tied else set()
        count = 0
        for module in self.modules():
            if isinstance(module, Int4Linear) and id(module) not in tied_head:
                count += module.in_features * module.out_features
            elif isinstance(module, QuantizedEmbedding) and not exclude_embeddings:
                count += module.num_embeddings * module.embedding_dim
            elif isinstance(module, WithBias) and id(module) not in tied_head:
                count += module.bias.numel()
        return count

    @classmethod
    def _from_config(cls, config: Any, **kwargs: Any) -> Any:
        """A model with fresh weights for ``config`` (a genkit ``ModelConfig``, a dict, or a
        transformers config); ``dtype=`` / ``torch_dtype=`` casts it."""
        from .base import ModelConfig
        from .loading import parse_dtype

        dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None)
        attn = kwargs.pop("attn_implementation", None)
        if kwargs:
            raise ConfigError(f"_from_config: unknown argument(s) {sorted(kwargs)}; accepted: dtype, torch_dtype, "
                              "attn_implementation ('sdpa' or 'eager')")
        model = cls(model_config_of(config))  # type: ignore[call-arg]
        if attn is not None:
            model.set_attn_implementation(attn)
        if dtype is not None:
            model = model.to(parse_dtype(dtype, ModelConfig()))
        return model

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike[str], **kwargs: Any) -> Any:
        """:func:`genkit.load_model` (a folder, a Hub id, a ``.gguf``), checked to give this class;
        ``torch_dtype=`` is read as ``dtype=``; ``attn_implementation`` (``"sdpa"`` or ``"eager"``,
        :meth:`set_attn_implementation`); ``low_cpu_mem_usage`` True only (genkit loads tensor by
        tensor). The other arguments are ``load_model``'s. On a subclass of a native class (one that
        adds methods), the loaded model is an instance of that subclass, as in transformers."""
        from .loading import load_model

        attn = kwargs.pop("attn_implementation", None)
        if kwargs.pop("low_cpu_mem_usage", True) is not True:
            raise ConfigError("`low_cpu_mem_usage`=False is not supported; accepted: True (genkit always loads the "
                              "weights tensor by tensor)")
        accepted = set(inspect.signature(load_model).parameters) - {"ref"}
        if "torch_dtype" in kwargs and "torch_dtype" not in accepted:
            if kwargs.get("dtype") is not None:
                raise ConfigError("pass `dtype` or `torch_dtype` (its old name), not both")
            kwargs["dtype"] = kwargs.pop("torch_dtype")
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            raise ConfigError(f"from_pretrained: unknown argument(s) {unknown}; accepted: {', '.join(sorted(accepted))}")
        model = load_model(pretrained_model_name_or_path, **kwargs)
        if not isinstance(model, cls) and issubclass(cls, type(model)):
            model.__class__ = cls  # a subclass that adds methods (its __init__ is the loaded class's)
        if not isinstance(model, cls):
            raise ConfigError(f"{os.fspath(pretrained_model_name_or_path)!r} holds a {type(model).__name__}, not a "
                              f"{cls.__name__}; use genkit.load_model to load any architecture")
        if attn is not None:
            model.set_attn_implementation(attn)
        return model

    def save_pretrained(self, save_directory: str | os.PathLike[str], *, safe_serialization: bool = True,
                        push_to_hub: bool = False, **kwargs: Any) -> None:
        """Write ``config.json``, ``generation_config.json`` and ``model.safetensors`` (tied weights
        once, under the input embedding's name, as transformers writes them) into
        ``save_directory``; with ``push_to_hub=True`` also upload the folder (``repo_id=``, default
        the folder's name, and :meth:`push_to_hub`'s other arguments)."""
        if not safe_serialization:
            raise NotSupportedError("`safe_serialization=False` (pickled weights) is not supported; genkit writes "
                                    "safetensors only")
        directory = os.fspath(save_directory)
        if os.path.isfile(directory):
            raise ConfigError(f"`save_directory` must be a folder; {directory!r} is a file")
        push_kwargs = dict(kwargs) if push_to_hub else {}
        if kwargs and not push_to_hub:
            raise ConfigError(f"save_pretrained: unknown argument(s) {sorted(kwargs)}; accepted: safe_serialization, "
                              "push_to_hub (and, with push_to_hub=True, push_to_hub's arguments)")
        from ..fileutil import atomic_write_text
        from .saving import config_json, write_safetensors

        os.makedirs(directory, exist_ok=True)
        atomic_write_text(os.path.join(directory, "config.json"), config_json(self))
        self.generation_config.save_pretrained(directory)  # type: ignore[attr-defined]
        write_safetensors(os.path.join(directory, "model.safetensors"), self.state_dict_to_save())
        logger.info("model saved in %s", directory)
        if push_to_hub:
            repo_id = push_kwargs.pop("repo_id", None) or os.path.basename(os.path.normpath(directory))
            _upload(directory, repo_id, **push_kwargs)

    def state_dict_to_save(self) -> dict[str, torch.Tensor]:
        """The persistent tensors by name, each shared tensor once (under its first name)."""
        assert isinstance(self, torch.nn.Module)
        seen: set[int] = set()
        out = {}
        for name, tensor in self.state_dict(keep_vars=True).items():
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            out[name] = tensor.detach()
        return out

    def push_to_hub(self, repo_id: str, *, commit_message: str | None = None, private: bool | None = None,
                    token: str | bool | None = None, revision: str | None = None, create_pr: bool = False,
                    commit_description: str | None = None) -> Any:
        """Save the model into a temporary folder and upload it to the Hub repo ``repo_id``
        (created if needed) with huggingface_hub; returns the ``CommitInfo``."""
        with tempfile.TemporaryDirectory(prefix="genkit-push-") as tmp:
            self.save_pretrained(tmp)
            return _upload(tmp, repo_id, commit_message=commit_message, private=private, token=token,
                           revision=revision, create_pr=create_pr, commit_description=commit_description)


def _upload(folder: str, repo_id: str, commit_message: str | None = None, private: bool | None = None,
            token: str | bool | None = None, revision: str | None = None, create_pr: bool = False,
            commit_description: str | None = None) -> Any:
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, exist_ok=True, private=private).repo_id
    if revision is not None:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    info = api.upload_folder(folder_path=folder, repo_id=repo_id, commit_message=commit_message or "Upload model",
                             commit_description=commit_description, revision=revision, create_pr=create_pr)
    logger.info("model pushed to %s", repo_id)
    return info


def model_config_of(config: Any) -> Any:
    """A genkit ``ModelConfig`` from a ``ModelConfig``, a dict or a transformers config."""
    from .base import ModelConfig
    from .loading import MODEL_TYPES

    if isinstance(config, ModelConfig):
        return ModelConfig(**config.to_dict())
    if isinstance(config, dict):
        return ModelConfig(**config)
    if hasattr(config, "to_dict"):
        data = config.to_dict()
        if not data.get("architectures") and data.get("model_type") in MODEL_TYPES:
            data["architectures"] = [MODEL_TYPES[data["model_type"]]]
        return ModelConfig(**data)
    raise ConfigError(f"`config` must be a genkit ModelConfig, a dict or a transformers config; got "
                      f"{type(config).__name__}")
