"""``load_model`` and ``load_tokenizer``: native models and their tokenizers from a Hub id, a local
HF-format folder, a ``.gguf`` file, or the demo-model alias.

Errors name what is wrong: the missing or unreadable file, the tensor whose shape does not match,
the architecture genkit does not know.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..errors import (
    ConfigError,
    CorruptModelError,
    ModelFileError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from ..tokenizer import Tokenizer, tokenizer_from_folder, tokenizer_from_gguf_metadata
from .base import GenkitModel, ModelConfig, shadowing_fields
from .limits import check_config, limit, over

logger = logging.getLogger("genkit.models")

# config.json "architectures[0]" -> "module:class"
ARCHITECTURES = {
    "LlamaForCausalLM": "genkit.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "genkit.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "genkit.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "genkit.models.llama:LlamaForCausalLM",
    "GPT2LMHeadModel": "genkit.models.gpt2:GPT2LMHeadModel",
}
# config.json "model_type" -> architecture, for configs without "architectures"
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "gpt2": "GPT2LMHeadModel"}

WEIGHT_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MODEL_FILE_PATTERNS = ["config.json", "generation_config.json", WEIGHT_FILE, INDEX_FILE,
                       "model-*-of-*.safetensors"]
TOKENIZER_FILE_PATTERNS = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                           "chat_template.jinja", "chat_template.json"]
RECIPE_ENTRY = "custom_generate/generate.py"

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def parse_dtype(dtype: torch.dtype | str | None, config: ModelConfig | None = None) -> torch.dtype:
    """A torch dtype from a dtype, a name ("float32", "bfloat16", "float16") or "auto"/None.

    None and "auto" use the checkpoint's ``dtype`` / ``torch_dtype`` from config.json (float32
    when it has none).
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ConfigError(f"`dtype`={dtype} is not supported; accepted: float32, bfloat16, float16, 'auto'")
        return dtype
    if dtype is None or dtype == "auto":
        saved = None if config is None else (config.dtype or config.torch_dtype)
        return _DTYPES.get(str(saved).removeprefix("torch."), torch.float32) if saved else torch.float32
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ConfigError(f"`dtype`={dtype!r} is not supported; accepted: float32, bfloat16, float16, 'auto'")


def _looks_like_hub_id(ref: str) -> bool:
    parts = ref.split("/")
    return len(parts) == 2 and all(parts) and not ref.startswith((".", "/", "~")) and not os.path.exists(ref)


def resolve_model_source(ref: str | os.PathLike[str], revision: str | None = None,
                         tokenizer_only: bool = False) -> str:
    """A local path for ``ref``: a folder or a ``.gguf`` file, downloading from the Hub if needed.

    A Hub download fetches only the files a model needs (config, weights, generation config,
    tokenizer files), or only the tokenizer files when ``tokenizer_only``.
    """
    from .demo import DEMO_ALIASES, DEMO_MODEL, ensure_demo_model

    ref = os.fspath(ref)
    path = os.path.expanduser(ref)
    if ref.lower() in DEMO_ALIASES and not os.path.exists(path):
        return ensure_demo_model()
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return path
        raise ConfigError(f"{path} is a file but not a .gguf; pass a model folder, a .gguf file or a Hub id")
    if os.path.isdir(path):
        return path
    if _looks_like_hub_id(ref):
        from huggingface_hub import snapshot_download

        from ..hubhttp import download_deadline

        patterns = TOKENIZER_FILE_PATTERNS if tokenizer_only else MODEL_FILE_PATTERNS + TOKENIZER_FILE_PATTERNS
        logger.info("fetching %s from the Hub (%s)", ref, "tokenizer files" if tokenizer_only else "model files")
        try:
            with download_deadline(f"the download of {ref}") as headers:
                return snapshot_download(ref, revision=revision, allow_patterns=patterns, headers=headers)
        except ConfigError:
            raise  # a genkit setting out of range (GENKIT_HUB_TIMEOUT, GENKIT_MODEL_DOWNLOAD_TIMEOUT)
        except Exception as exc:
            raise hub_fetch_error(ref, revision, exc) from exc
    raise ModelNotFoundError(
        f"model {ref!r} not found: pass an existing folder, a .gguf file, a Hub id 'org/name', "
        f"or {DEMO_MODEL!r} (the demo model)"
    )


def model_config(ref: str | os.PathLike[str], revision: str | None = None) -> ModelConfig | None:
    """The ``config.json`` of a model folder or Hub id (of a Hub model, only that file is fetched),
    without its weights; None for a ``.gguf`` file or the demo model (whose config is its header)."""
    from .demo import DEMO_ALIASES

    ref = os.fspath(ref)
    path = os.path.expanduser(ref)
    if os.path.isdir(path):
        return read_config_json(_config_path(path))
    if os.path.exists(path) or ref.lower() in DEMO_ALIASES or not _looks_like_hub_id(ref):
        return None
    from huggingface_hub import hf_hub_download

    from ..hubhttp import download_deadline

    try:
        with download_deadline(f"the download of {ref}'s config.json") as headers:
            return read_config_json(hf_hub_download(ref, "config.json", revision=revision, headers=headers))
    except (ConfigError, ModelFileError):
        raise
    except Exception as exc:
        raise hub_fetch_error(ref, revision, exc) from exc


def _config_path(folder: str) -> str:
    """The ``config.json`` of a model folder, or a :class:`ModelNotFoundError` when it has none."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"no config.json in {folder}")
    return path


def hub_fetch_error(ref: str, revision: str | None, exc: Exception) -> ModelLoadError:
    """A one-line error for a Hub model that could not be fetched: offline, missing repo or revision."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from ..hubhttp import hub_timeout_of

    where = f"model {ref!r}" + (f" at revision {revision!r}" if revision else "")
    timeout = hub_timeout_of(exc)  # the Hub client may report it in an error of its own
    if timeout is not None:
        why = f"the Hub was too slow: {timeout}"
    elif isinstance(exc, RevisionNotFoundError):
        why = "the Hub repo has no such revision"
    elif isinstance(exc, GatedRepoError):
        why = "the Hub repo is gated: accept its terms on the Hub and log in (`hf auth login`)"
    elif isinstance(exc, RepositoryNotFoundError):
        why = "no such Hub repo (or it is private and you are not logged in); check the id"
    elif isinstance(exc, LocalEntryNotFoundError) or constants.HF_HUB_OFFLINE:
        why = ("the Hub cannot be reached (this machine is offline or HF_HUB_OFFLINE=1) and the model is not in "
               "the local Hub cache; connect and retry, or pass a local folder or .gguf file")
    else:
        why = f"fetching it from the Hub failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return ModelLoadError(f"could not load {where}: {why}")


def architecture_class(config: ModelConfig, where: str = "config.json") -> type[GenkitModel]:
    """The native class for a config's ``architectures[0]`` (or ``model_type``)."""
    from ..plugins import resolve

    archs = config.architectures or ([MODEL_TYPES[config.model_type]] if config.model_type in MODEL_TYPES else None)
    if not archs:
        raise UnsupportedModelError(f"{where}: no 'architectures' and unknown model_type {config.model_type!r}; "
                                    f"supported architectures: {', '.join(sorted(ARCHITECTURES))}")
    arch = archs[0]
    if arch not in ARCHITECTURES and getattr(config, "vision_config", None) is not None:
        raise UnsupportedModelError(
            f"{where}: {arch} is a multimodal model (its config has a vision_config): genkit has no native loader "
            "for it; load it with transformers (e.g. transformers.AutoModelForImageTextToText.from_pretrained) and "
            "pass it to genkit.generate with its image inputs (docs/encoder_decoder.md)")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"{where}: unknown architecture {arch!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
    if arch != "GPT2LMHeadModel":
        act = config.hidden_act or "silu"
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"{where}: hidden_act {act!r} is not supported for {arch}; accepted: 'silu'")
    return resolve(ARCHITECTURES[arch])


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


class SafetensorsState(Mapping[str, torch.Tensor]):
    """The tensors of one or more safetensors files, read one at a time on access.

    Only the JSON headers are read up front (and checked: offsets inside the file, known dtypes,
    sizes that match the shapes). Each tensor is then read with a plain file read when it is
    asked for, so loading a model costs the model plus one tensor -- no memory map of the whole
    checkpoint, no second copy of it.
    """

    def __init__(self, files: list[str]) -> None:
        self._entries: dict[str, tuple[str, torch.dtype, tuple[int, ...], int, int]] = {}
        for f in files:
            if not os.path.isfile(f):
                raise ModelNotFoundError(f"weights file {f} is missing (listed in {INDEX_FILE})")
            for name, (dtype, shape, offset, nbytes) in safetensors_header(f).items():
                self._entries[name] = (f, dtype, shape, offset, nbytes)

    def __getitem__(self, name: str) -> torch.Tensor:
        path, dtype, shape, offset, nbytes = self._entries[name]
        # a bytearray the tensor then shares (torch.frombuffer, no copy): numpy is not a dependency
        raw = bytearray(nbytes)
        with open(path, "rb") as fh:
            fh.seek(offset)
            got = fh.readinto(raw) if nbytes else 0
        if got != nbytes:
            raise CorruptModelError(f"weights file {path} is corrupt: tensor {name!r} is cut short")
        buf = torch.frombuffer(raw, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        return buf.view(dtype).reshape(shape)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][2]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


def safetensors_header(path: str) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
    """The tensors a safetensors file's header lists: name -> (dtype, shape, offset in the file,
    bytes). The header's length is bounded (``GENKIT_MAX_SAFETENSORS_HEADER``) and every entry is
    checked (known dtype, non-negative shape, bytes that match it, inside the file) before use; a
    refusal is a :class:`~genkit.errors.ModelFileError` naming the file and the field."""
    def bad(why: str) -> ModelFileError:
        return ModelFileError(f"weights file {path} is corrupt or not a safetensors file ({why})")

    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(8)
        if len(head) < 8:
            raise bad("file shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > limit("safetensors_header_bytes"):
            raise bad(f"the header length is {n} bytes; {over('safetensors_header_bytes')}")
        if n <= 0 or 8 + n > size:
            raise bad(f"the header length {n} does not fit in a file of {size} bytes")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise bad(f"the header is not UTF-8 JSON: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    entries = {}
    for name, info in header.items():
        if name != "__metadata__":
            entries[name] = _header_entry(name, info, 8 + n, size, bad)
    return entries


def _header_entry(name: str, info: Any, base: int, size: int,
                  bad: Any) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    if not isinstance(info, dict):
        raise bad(f"tensor {name!r}: its entry is not a JSON object")
    dtype = _ST_DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
    if dtype is None:
        raise bad(f"tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"tensor {name!r}: `shape` must be a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(x) is int for x in offsets):
        raise bad(f"tensor {name!r}: `data_offsets` must be two integers")
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
    if end - begin != numel * dtype.itemsize or begin < 0 or base + end > size:
        raise bad(f"tensor {name!r}: bytes {begin}..{end} do not match shape {tuple(shape)} "
                  f"or lie beyond the end of the file ({size} bytes; truncated?)")
    return dtype, tuple(shape), base + begin, end - begin


def read_safetensors(folder: str) -> SafetensorsState:
    """The tensors of ``model.safetensors``, or of the shards listed in the index file (read
    lazily). The index may only name files inside ``folder`` (no absolute paths, no ``..``, no
    symlink out)."""
    single = os.path.join(folder, WEIGHT_FILE)
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        files = [_shard_path(folder, index, f) for f in sorted(set(_weight_map(index).values()))]
    else:
        raise ModelNotFoundError(f"no weights in {folder}: expected {WEIGHT_FILE} or {INDEX_FILE}")
    return SafetensorsState(files)


def _weight_map(index: str) -> dict[str, str]:
    if os.path.getsize(index) > limit("config_bytes"):
        raise ModelFileError(f"{index}: {os.path.getsize(index)} bytes; {over('config_bytes')}")
    try:
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise ModelFileError(f"{index}: not a valid safetensors index ({type(exc).__name__}: {exc})") from exc
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelFileError(f"{index}: `weight_map` must map tensor names to file names")
    return weight_map


def _shard_path(folder: str, index: str, name: str) -> str:
    """The path of a shard the index names, which must lie inside the model folder."""
    path = os.path.join(folder, name)
    real = os.path.realpath(path)
    if os.path.isabs(name) or ".." in name.replace("\\", "/").split("/") or \
            not any(os.path.commonpath([root, real]) == root for root in _shard_roots(folder)):
        raise ModelFileError(f"{index}: `weight_map` names {name!r}, which is not a file inside the model folder "
                             f"{folder}; shards must lie in the model's folder")
    return path


def _shard_roots(folder: str) -> list[str]:
    """Where a shard's file may really lie: the model folder, and for a Hub cache snapshot
    (``models--org--name/snapshots/<sha>``, whose files are links into the repo's ``blobs/``) that
    repo's blob store."""
    roots = [os.path.realpath(folder)]
    parent = os.path.dirname(os.path.abspath(folder))
    if os.path.basename(parent) == "snapshots":
        roots.append(os.path.realpath(os.path.join(os.path.dirname(parent), "blobs")))
    return roots


def _shape(state: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    shape = getattr(state, "shape", None)
    return shape(name) if callable(shape) else tuple(state[name].shape)


def _warn_if_bfloat16_is_emulated(dtype: torch.dtype, device: str | torch.device | None) -> None:
    """bfloat16 on a CPU without oneDNN's bfloat16 kernels (no AVX-512 BF16/BW or AVX-NE-CONVERT)
    runs emulated, several times slower than float32: say so."""
    from .llama_infer import packing_available

    if dtype == torch.bfloat16 and torch.device(device or "cpu").type == "cpu" and not packing_available(dtype):
        logger.warning("bfloat16 on this CPU has no native kernels and runs several times slower than float32 "
                       "here; load with dtype=torch.float32 for speed")


def build_model(config: ModelConfig, state: Mapping[str, torch.Tensor], dtype: torch.dtype,
                where: str = "", device: str | torch.device | None = None,
                model: GenkitModel | None = None) -> GenkitModel:
    """Instantiate the config's architecture (or take ``model``, built on the meta device) and load
    ``state`` into it, checking names and shapes."""
    if model is None:
        cls = architecture_class(config, os.path.join(where, "config.json") if where else "config.json")
        with torch.device("meta"):
            model = cls(config)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    _check_state(model, state, where)  # on the meta device: nothing is allocated for a bad file
    # allocate once, in the target dtype and on the target device, then copy the tensors in
    model = model.to(dtype).to_empty(device=device if device is not None else "cpu")
    _warn_if_bfloat16_is_emulated(dtype, device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    targets = _targets(model)
    with torch.no_grad():
        for name, target in targets.items():
            if name in state:
                target.copy_(state[name])
    if hasattr(model, "reset_buffers"):
        model.reset_buffers()  # float32 rope frequencies, whatever the weights' dtype
    return model.eval()


def _targets(model: GenkitModel) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters(remove_duplicate=False))
    persistent = set(model.state_dict())
    return {**params, **{k: v for k, v in model.named_buffers() if k in persistent}}


def _check_state(model: GenkitModel, state: Mapping[str, torch.Tensor], where: str) -> None:
    """The checkpoint's names and shapes against the model's (tied tensors may appear under any
    one of their names); a :class:`~genkit.errors.ModelFileError` on the first mismatch."""
    targets = _targets(model)
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    twins = {name: names for names in by_id.values() if len(names) > 1 for name in names}
    missing = [k for k in targets if k not in state and not any(t in state for t in twins.get(k, ()))]
    if missing:
        raise ModelFileError(f"{where or 'checkpoint'}: missing tensors {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''} for {type(model).__name__}")
    unexpected = [k for k in state if k not in targets]
    if unexpected:
        logger.warning("%s: ignoring %d tensors the model does not use: %s", where or "checkpoint",
                       len(unexpected), unexpected[:8])
    for name in state:
        if name in targets and _shape(state, name) != tuple(targets[name].shape):
            raise ModelFileError(f"{where or 'checkpoint'}: tensor {name!r} has shape {_shape(state, name)}, "
                                 f"but the config implies {tuple(targets[name].shape)}")


def read_config_json(path: str) -> ModelConfig:
    """``config.json`` as a :class:`ModelConfig`: a JSON object of bounded size
    (``GENKIT_MAX_CONFIG_BYTES``), or a :class:`~genkit.errors.ModelFileError` naming the file."""
    size = os.path.getsize(path)
    if size > limit("config_bytes"):
        raise ModelFileError(f"{path}: {size} bytes; {over('config_bytes')}")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (ValueError, RecursionError) as exc:
        raise ModelFileError(f"{path}: not valid JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise ModelFileError(f"{path}: not a JSON object of config fields")
    shadowing = shadowing_fields(data)
    if shadowing:  # {"get": 5} would replace the method every reader of the config calls
        raise ModelFileError(f"{path}: {', '.join(map(repr, shadowing))} cannot be a config field (the name of a "
                             "ModelConfig method or attribute)")
    return ModelConfig(**data)


def _check_flags(dequantize: object, trust_remote_code: object) -> None:
    """``dequantize`` is a bool; ``trust_remote_code`` True, False or None (a string "true" would
    leave the repo's recipe unbound, silently), before anything is downloaded."""
    from ..recipes.trust import check_flag

    if not isinstance(dequantize, bool):
        raise ConfigError(f"`dequantize` must be True or False; got {dequantize!r}")
    check_flag(trust_remote_code)


def load_model(ref: str | os.PathLike[str], revision: str | None = None, dtype: torch.dtype | str | None = None,
               device: str | torch.device | None = None, trust_remote_code: bool | None = None,
               dequantize: bool = False, *, torch_dtype: torch.dtype | str | None = None,
               device_map: Any = None, activation_digits: int | None = None, numerics: str | None = None) -> GenkitModel:
    """Load a native model (an encoder-decoder checkpoint -- ``is_encoder_decoder`` in its
    ``config.json``: T5, BART, Pegasus, Marian, Whisper... -- is loaded by transformers and wrapped
    in genkit's adapter, :func:`genkit.models.seq2seq.load_seq2seq`).

    Args:
        ref: a local folder in Hugging Face format (``config.json`` + ``model.safetensors`` or
            sharded safetensors with ``model.safetensors.index.json``), a ``.gguf`` file (needs the
            ``gguf`` extra), a Hub id ``"org/name"``, or ``"smollm2"`` (the demo model).
        revision: Hub branch, tag or commit.
        dtype: float32, bfloat16, float16 (torch dtype or name), or None/"auto" for the checkpoint's.
        device: where to put the model ("cpu", "cuda", ...).
        trust_remote_code: when True and the repo/folder ships ``custom_generate/generate.py``,
            ``model.generate`` runs that recipe.
        dequantize: GGUF only. False (the default) keeps Q4_0, Q4_1, Q4_K and Q8_0 tensors quantized
            and runs them with int4 weight-only CPU kernels (see docs/models.md, "Quantized
            weights"); True de-quantizes every tensor to ``dtype`` (the float path). On a GPU, or
            when torch lacks the kernels, GGUF files are de-quantized.
        torch_dtype: transformers' older name of ``dtype`` (give one of them).
        device_map: transformers' placement argument, for one device: ``"auto"`` (the GPU when
            there is one, else the CPU), ``"cpu"``, a device (``"cuda:0"``, ``0``, a
            ``torch.device``) or ``{"": device}``. Splitting a model over several devices is not
            supported.
        activation_digits: quantized models only: 2 (the default) or 1, how the block kernel rounds
            activations (:func:`genkit.models.quant.set_activation_digits`; docs/models.md,
            "Activation rounding"). Given for a model that is not quantized: a ConfigError.
        numerics: quantized GGUF models only: ``"genkit"`` (the default) or ``"llama.cpp"``, every
            float operation of a step as llama.cpp's CPU backend (built for this CPU) does it, so
            greedy decoding gives its tokens; ``"llama.cpp-avx2"``, ``"llama.cpp-avx512"``, ``"llama.cpp-avx512-fp16"``
            follow that build (:func:`genkit.models.quant.set_numerics`; docs/models.md, "llama.cpp
            numerics"). Implies one activation digit: ``activation_digits=2`` with it is a ConfigError.
    """
    _check_flags(dequantize, trust_remote_code)
    if activation_digits is not None:
        from .block_kernel import check_activation_digits

        check_activation_digits(activation_digits)
    if numerics is not None:
        from .numerics import check_numerics, is_llama_numerics

        if is_llama_numerics(check_numerics(numerics)) and activation_digits == 2:
            raise ConfigError(f"`numerics`={numerics!r} rounds activations to one digit as llama.cpp does; "
                              "`activation_digits`=2 contradicts it (leave it out, or give 1)")
    dtype = _one_dtype(dtype, torch_dtype)
    device = device_from_map(device_map, device)
    check_device(device)
    source = resolve_model_source(ref, revision=revision)
    if source.endswith(".gguf"):
        model, config = _load_gguf(source, dtype, device, dequantize)
    else:
        model, config = _load_folder(source, dtype, device)
        if config is None:  # an encoder-decoder model, loaded by transformers
            return _numerics(_activation_digits(model, activation_digits), numerics)
    config.name_or_path = os.fspath(ref)
    config.dtype = model.dtype  # the weights' dtype, as transformers' from_pretrained leaves it
    _attach_recipe(model, os.fspath(ref), source, revision, trust_remote_code)
    return _numerics(_activation_digits(model, activation_digits), numerics)


def _numerics(model: Any, numerics: str | None) -> Any:
    """The model with ``numerics`` applied when it was given (refused where it cannot hold)."""
    if numerics is None:
        return model
    from .quant import set_numerics

    return set_numerics(model, numerics)


def _activation_digits(model: Any, digits: int | None) -> Any:
    """The model with ``activation_digits`` applied when it was given (refused for a float model)."""
    if digits is None:
        return model
    from .quant import set_activation_digits

    return set_activation_digits(model, digits)


def _one_dtype(dtype: Any, torch_dtype: Any) -> Any:
    """``dtype`` or its older name ``torch_dtype`` (transformers accepts both); both given must agree."""
    if torch_dtype is None:
        return dtype
    if dtype is not None and dtype != torch_dtype:
        raise ConfigError(f"`dtype`={dtype!r} and `torch_dtype`={torch_dtype!r} disagree; pass one of them "
                          "(`torch_dtype` is the older name of `dtype`)")
    return torch_dtype


DEVICE_MAP_ACCEPTED = ("'auto', 'cpu', a single device ('cuda', 'cuda:0', 0, a torch.device) or {'': device}; "
                       "genkit puts the whole model on one device")


def device_from_map(device_map: Any, device: str | torch.device | None = None) -> str | torch.device | None:
    """The one device transformers' ``device_map`` names: ``"auto"`` is the first GPU when torch
    has one (else the CPU); ``{"": d}``, a device name, an index or a ``torch.device`` is that
    device. A map over several devices (or ``"balanced"``, ``"sequential"``) is a ConfigError, as
    is a ``device`` that disagrees."""
    if device_map is None:
        return device
    target: Any = device_map
    if isinstance(device_map, dict):
        devices = set(device_map.values())
        if set(device_map) != {""} or len(devices) != 1:
            raise ConfigError(f"`device_map`={device_map!r} splits the model over modules or devices; accepted: "
                              f"{DEVICE_MAP_ACCEPTED}")
        target = device_map[""]
    if target == "auto":
        target = "cuda:0" if torch.cuda.is_available() else "cpu"
    elif isinstance(target, int) and not isinstance(target, bool):
        target = f"cuda:{target}"
    elif isinstance(target, str) and target in ("balanced", "balanced_low_0", "sequential"):
        raise ConfigError(f"`device_map`={device_map!r} spreads the model over devices; accepted: {DEVICE_MAP_ACCEPTED}")
    if not isinstance(target, (str, torch.device)):
        raise ConfigError(f"`device_map`={device_map!r} is not valid; accepted: {DEVICE_MAP_ACCEPTED}")
    try:
        resolved = torch.device(target)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"`device_map`={device_map!r} is not valid; accepted: {DEVICE_MAP_ACCEPTED}") from None
    if device is not None and torch.device(device) != resolved:
        raise ConfigError(f"`device`={device!r} and `device_map`={device_map!r} disagree; pass one of them")
    return target


def _load_gguf(source: str, dtype: Any, device: Any, dequantize: bool) -> tuple[GenkitModel, ModelConfig]:
    from .gguf import read_gguf

    keep = frozenset() if dequantize or not _quantized_kernels_for(device) else _kernel_types()
    contents = read_gguf(source, keep_quantized=keep)
    config = ModelConfig(**contents.config)
    if contents.quantized:
        from .gguf_quantized import build_quantized_model

        return build_quantized_model(config, contents, parse_dtype(dtype, config), where=source), config
    return build_model(config, contents.state_dict, parse_dtype(dtype, config), where=source, device=device), config


def _load_folder(source: str, dtype: Any, device: Any) -> tuple[Any, ModelConfig | None]:
    """The folder's model and config; an encoder-decoder checkpoint (T5, BART, Whisper...) is loaded
    through transformers and given with no config."""
    cfg_path = _config_path(source)
    config = read_config_json(cfg_path)
    if getattr(config, "is_encoder_decoder", False):
        from .seq2seq import load_seq2seq

        return load_seq2seq(source, parse_dtype(dtype, None) if dtype not in (None, "auto") else None, device), None
    if getattr(config, "vision_config", None) is not None and isinstance(config.architectures, list) \
            and all(isinstance(a, str) for a in config.architectures):  # named before its text fields are missed
        architecture_class(config, cfg_path)
    check_config(config, cfg_path)  # types and sizes first: nothing is read or built for a bad config
    architecture_class(config, cfg_path)  # fail on an unknown architecture before reading weights
    state = read_safetensors(source)
    check_config(config, cfg_path, {name: state.shape(name) for name in state})
    model = build_model(config, state, parse_dtype(dtype, config), where=source, device=device)
    if os.path.isfile(os.path.join(source, "generation_config.json")):
        from ..config import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(source)
    return model, config


def available_devices() -> list[str]:
    """The device names this torch build and machine have: ``cpu``, then ``cuda`` and each
    ``cuda:N``, then ``mps`` (what ``check_device`` accepts, for messages that list them)."""
    names = ["cpu"]
    if torch.cuda.is_available():
        names += ["cuda"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        names.append("mps")
    return names


def check_device(device: str | torch.device | None) -> None:
    """A :class:`~genkit.errors.ConfigError` when ``device`` is not a device this torch build and
    machine have (``"cuda"`` on a CPU-only build, a GPU index past the last one, ...)."""
    if device is None:
        return
    from ..errors import ConfigError

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ConfigError(f"`device`={device!r} is not a torch device ({exc}); e.g. 'cpu', 'cuda', 'cuda:0'") from None
    if dev.type == "cpu" or dev.type == "meta":
        return
    backend = getattr(torch, dev.type, None) if dev.type != "mps" else torch.backends.mps
    if backend is None or not backend.is_available():
        why = ("this torch build has no CUDA support (a CPU-only build)" if dev.type == "cuda" and torch.version.cuda
               is None else f"no {dev.type} device is available to this process")
        raise ConfigError(f"`device`={device!r}: {why}; use device='cpu'")
    count = getattr(backend, "device_count", lambda: 1)()
    if dev.index is not None and dev.index >= count:
        raise ConfigError(f"`device`={device!r}: there are {count} {dev.type} device(s) (indices 0 to {count - 1})")


def _kernel_types() -> frozenset[str]:
    from .gguf_quantized import kernel_types

    return kernel_types()


def _quantized_kernels_for(device: str | torch.device | None) -> bool:
    """Whether GGUF tensors can stay quantized on ``device`` (the int4 kernels are CPU kernels)."""
    if device is not None and torch.device(device).type != "cpu":
        return False
    from .quant import kernel_available

    return kernel_available()


def _has_recipe(ref: str, source: str, revision: str | None) -> bool:
    if os.path.isdir(source) and os.path.isfile(os.path.join(source, RECIPE_ENTRY)):
        return True
    if os.path.isdir(os.path.expanduser(ref)) or not _looks_like_hub_id(ref):
        return False
    from huggingface_hub import file_exists

    try:
        return bool(file_exists(ref, RECIPE_ENTRY, revision=revision))
    except Exception as exc:  # noqa: BLE001 - the Hub not answering must not stop loading the model
        logger.warning("could not check %s for %s: %s", ref, RECIPE_ENTRY, exc)
        return False


def _attach_recipe(model: GenkitModel, ref: str, source: str, revision: str | None,
                   trust_remote_code: bool | None) -> None:
    """Bind the repo's ``custom_generate`` recipe as ``model.generate`` (trusted repos only)."""
    if trust_remote_code is not True:
        if os.path.isdir(source) and os.path.isfile(os.path.join(source, RECIPE_ENTRY)):
            logger.warning("%s ships %s; pass trust_remote_code=True to use it as model.generate", ref,
                           RECIPE_ENTRY)
        return
    if not _has_recipe(ref, source, revision):
        return
    from ..recipes import load_recipe

    recipe_ref = ref if _looks_like_hub_id(ref) else source
    recipe = load_recipe(recipe_ref, trust_remote_code=True, revision=revision)

    def generate(*args: Any, **kwargs: Any) -> Any:
        # the model as transformers gives it to a repo's recipe: a transformers model (the view)
        from .hf_view import model_for_recipe

        if args:
            kwargs["inputs"] = args[0] if len(args) == 1 else args
        return recipe.generate(model_for_recipe(model), **kwargs)

    generate.__doc__ = f"generate() from the recipe in {ref}/custom_generate"
    model.generate = generate  # type: ignore[method-assign]
    model.custom_generate_recipe = recipe


def tokenizer_from_gguf(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer stored in a ``.gguf`` file's metadata."""
    from .gguf import open_gguf, read_gguf_tokenizer

    return tokenizer_from_gguf_metadata(read_gguf_tokenizer(open_gguf(path), path), name_or_path=os.fspath(path))


def load_tokenizer(ref: str | os.PathLike[str], revision: str | None = None) -> Tokenizer:
    """Load a tokenizer from a local folder, a ``.gguf`` file, a Hub id, or a demo-model alias.

    Args:
        ref: folder with ``tokenizer.json``; path to a ``.gguf``; ``"org/name"`` on the Hub (only
            the tokenizer files are fetched); or ``"smollm2"`` (the demo model, see docs/models.md).
        revision: Hub branch, tag or commit.
    """
    source = resolve_model_source(ref, revision=revision, tokenizer_only=True)
    if source.endswith(".gguf"):
        return tokenizer_from_gguf(source)
    return tokenizer_from_folder(source)
