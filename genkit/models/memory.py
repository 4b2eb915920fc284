"""How much memory a generation's sequences take, and how much there is.

One estimate of a sequence's key/value cache (:func:`kv_bytes_per_position`), read by continuous
batching to size its paged cache and by ``generate`` to refuse, before anything is allocated, a
generation whose sequences would not fit (:func:`generation_memory`, checked by
:func:`genkit.config.resolve.check_memory` where the lengths are resolved). The memory available
(:func:`available_memory`) is read from the system, without psutil: on Linux ``/proc/meminfo``'s
MemAvailable, bounded by the process's cgroup (``memory.max``) and address-space limit (``ulimit
-v``); a CUDA device's free memory; else the machine's physical memory.
``GENKIT_MAX_GENERATION_BYTES`` (bytes) sets the figure instead.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..config.checks import model_vocab_size
from ..config.resolve import MemoryBudget
from .base import ModelConfig, head_dim_of, kv_heads_of
from .limits import env_int

__all__ = ["MEMORY_VARIABLE", "available_memory", "generation_memory", "kv_bytes_per_position"]

#: the environment variable that sets the memory a generation may hold (bytes)
MEMORY_VARIABLE = "GENKIT_MAX_GENERATION_BYTES"
# what a sequence holds per position besides its cache: its token id and attention mask (int64 each)
_IDS_PER_POSITION = 16
# beam search, per beam: the ids of its candidates (two per beam), of the finished hypotheses and their
# merge with the candidates, at most 8 int64 per position at once; and 3 more float32 rows of the
# vocabulary per step (the log-softmax, its sum with the beam's score, beam sampling's softmax)
_BEAM_IDS_PER_POSITION = 8 * 8
_BEAM_SCORE_ROWS = 3
# transformers' configs name these differently (GPT-2's n_layer, T5's num_decoder_layers and d_kv)
_LAYERS = ("num_decoder_layers", "num_hidden_layers", "n_layer", "num_layers")
_KV_HEADS = ("num_key_value_heads", "num_attention_heads", "n_head", "num_heads")


def kv_bytes_per_position(config: Any, itemsize: int = 4) -> int:
    """The bytes one sequence's key/value cache takes per position: a key and a value of
    ``head_dim`` numbers of ``itemsize`` bytes for each key/value head of each (decoder) layer. A
    native model's :class:`ModelConfig` is read as the models read it (``head_dim_of``,
    ``kv_heads_of``); a transformers config by its usual names (its text decoder's). 0 when the
    config does not say."""
    if isinstance(config, ModelConfig):
        layers, heads, head_dim = config.num_hidden_layers, kv_heads_of(config), head_dim_of(config)
    else:
        text = _text_config(config)
        layers, heads = _first(text, _LAYERS), _first(text, _KV_HEADS)
        attention_heads = _first(text, ("num_attention_heads", "n_head", "num_heads"))
        width = _first(text, ("hidden_size", "n_embd", "d_model"))
        head_dim = _first(text, ("head_dim", "d_kv")) or (width // attention_heads if width and attention_heads else 0)
    if not all(isinstance(v, int) and v > 0 for v in (layers, heads, head_dim)):
        return 0
    return 2 * int(layers) * int(heads) * int(head_dim) * itemsize


def _text_config(config: Any) -> Any:
    """A transformers config's text decoder's (``get_text_config``), else ``config`` itself."""
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config(decoder=True) if callable(get_text_config) else config


def _first(config: Any, names: tuple[str, ...]) -> int:
    """The first of ``names`` that ``config`` holds as a positive int, else 0."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def generation_memory(model: Any, *, assistant: Any = None, guidance: bool = False, encoder_positions: int = 0,
                      negative_positions: int = 0, config: Any = None) -> MemoryBudget | None:
    """What one sequence of a generation on ``model`` holds (its token ids and attention mask, its
    key/value cache in the model's dtype, a float32 row of logits) and the memory available on the
    model's device; ``None`` where the memory available is not known. Also counted: an
    encoder-decoder model's cross-attention cache over its ``encoder_positions``; with ``guidance``
    (classifier-free guidance) the unconditional branch's cache and logits on the same model, its
    negative prompt's ``negative_positions`` beyond the prompt included; an ``assistant`` model's
    (assisted decoding) token ids, cache (its cross-attention too) and logits; and with the
    generation ``config``, beam search's per-step work (when its ``num_beams`` > 1) and the outputs
    it asks to record (:func:`_recorded`)."""
    device = torch.device(getattr(model, "device", "cpu"))
    found = available_memory(device)
    if found is None:
        return None
    kv, logits = _sequence_bytes(model)
    per_position, per_sequence = kv + _IDS_PER_POSITION, logits + encoder_positions * kv
    if guidance:
        per_position, per_sequence = per_position + kv, per_sequence + logits + max(negative_positions, 0) * kv
    if assistant is not None:
        assistant_kv, assistant_logits = _sequence_bytes(assistant)
        per_position += assistant_kv + _IDS_PER_POSITION
        per_sequence += assistant_logits + (encoder_positions * assistant_kv if encoder_positions else 0)
    beams = getattr(config, "num_beams", 1)
    if isinstance(beams, int) and beams > 1:
        per_position, per_sequence = per_position + _BEAM_IDS_PER_POSITION, per_sequence + _BEAM_SCORE_ROWS * logits
    recorded, per_pair = _recorded(model, config, encoder_positions)
    return MemoryBudget(per_position=per_position + recorded, per_sequence=per_sequence, available=found[0],
                        source=found[1], vocab_size=model_vocab_size(model), per_pair=per_pair,
                        outputs=bool(recorded or per_pair))


def _recorded(model: Any, config: Any, encoder_positions: int) -> tuple[int, int]:
    """Bytes per position and per square of positions that the outputs ``config`` asks for hold for
    one sequence: ``output_scores`` and ``output_logits`` a float32 row of the vocabulary per step,
    ``output_hidden_states`` each layer's hidden state (and the embeddings') per position,
    ``output_attentions`` each layer's heads' weights over the positions before (their squares; the
    cross-attentions over the encoder per position). Float32 counted for every dtype."""
    if config is None:
        return 0, 0
    text = _text_config(getattr(model, "config", None))
    vocab = 4 * (model_vocab_size(model) or 0)
    per = vocab * (bool(getattr(config, "output_scores", False)) + bool(getattr(config, "output_logits", False)))
    layers = _first(text, _LAYERS)
    if getattr(config, "output_hidden_states", False):
        per += 4 * (layers + 1) * _first(text, ("hidden_size", "n_embd", "d_model"))
    if not getattr(config, "output_attentions", False):
        return per, 0
    heads = 4 * layers * _first(text, ("num_attention_heads", "n_head", "num_heads"))
    return per + heads * encoder_positions, heads


def _sequence_bytes(model: Any) -> tuple[int, int]:
    """A sequence's key/value cache per position on ``model`` (in its dtype) and its float32 row of logits."""
    dtype = getattr(model, "dtype", torch.float32)
    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) and dtype.is_floating_point else 4
    return kv_bytes_per_position(getattr(model, "config", None), itemsize), 4 * (model_vocab_size(model) or 0)


def available_memory(device: torch.device | str = "cpu") -> tuple[int, str] | None:
    """The bytes a generation on ``device`` may still allocate, and where the figure comes from:
    ``GENKIT_MAX_GENERATION_BYTES`` when set; a CUDA device's free memory (with what torch's caching
    allocator holds unused); on the CPU the least of ``/proc/meminfo``'s MemAvailable, what the
    process's cgroup has left and what its address-space limit has left, else the machine's physical
    memory; ``None`` for another device."""
    value = env_int(MEMORY_VARIABLE, "a positive number of bytes")
    if value is not None:
        return value, MEMORY_VARIABLE
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + max(cached, 0)), f"free memory of {device}"
    if device.type != "cpu":
        return None
    found = [f for f in (_meminfo(), _cgroup(), _address_space()) if f is not None]
    if not found:
        physical = _physical()
        return (physical, "the machine's physical memory") if physical else None
    return min(found)


def _meminfo() -> tuple[int, str] | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None  # no such file, or "max" (no limit)


def _cgroup() -> tuple[int, str] | None:
    """What the process's cgroup (v2, else v1) may still take; ``None`` without a limit."""
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        most, used = _read_int(limit), _read_int(usage)
        if most is not None and used is not None and most < 1 << 60:  # v1 writes a huge number for no limit
            return max(most - used, 0), f"the cgroup's memory limit ({limit})"
    return None


def _address_space() -> tuple[int, str] | None:
    """What the address-space limit (``ulimit -v``) leaves: the limit less the process's size."""
    try:
        import resource
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return None
    size = 0
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmSize:"):
                    size = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return max(soft - size, 0), "the address-space limit (ulimit -v)"


def _physical() -> int | None:
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None
