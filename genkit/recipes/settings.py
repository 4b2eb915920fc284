"""User settings for recipes and the Hub client, read at call time (not at import).

* ``GENKIT_HOME`` (default ``~/.cache/genkit``): holds ``settings.json``, manifests and locks.
* ``settings.json``: ``{"trusted_repos": ["org/*", "me/recipe@<sha>"], "trust_local_recipes": true}``.
* ``GENKIT_TRUSTED_REPOS``: comma/space separated patterns added to the file's list.
* ``GENKIT_TRUST_LOCAL_RECIPES=0``: local recipe folders need ``trust_remote_code=True`` too.
* ``GENKIT_HUB_RETRIES`` (3) and ``GENKIT_HUB_TIMEOUT`` (10 s): Hub request policy.
* Hub client: ``HF_ENDPOINT``, ``HF_HUB_CACHE`` / ``HF_HOME``, ``HF_HUB_OFFLINE`` — read from the
  environment on every call, falling back to ``huggingface_hub.constants``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger("genkit.recipes")

_FALSE = {"0", "false", "no", "off"}
_TRUE = {"1", "true", "yes", "on"}


def genkit_home() -> Path:
    """``$GENKIT_HOME`` or ``~/.cache/genkit``."""
    return Path(os.path.expanduser(os.environ.get("GENKIT_HOME") or "~/.cache/genkit"))


def load_settings() -> dict[str, Any]:
    """The parsed ``$GENKIT_HOME/settings.json`` ({} when absent). A broken file is an error."""
    path = genkit_home() / "settings.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read genkit settings {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"genkit settings {path} must hold a JSON object")  # noqa: TRY004
    return data


def trusted_repos() -> list[str]:
    """Trusted-repo patterns from ``GENKIT_TRUSTED_REPOS`` and ``settings.json`` (``org/*``, ``org/repo``,
    ``org/repo@<sha>``)."""
    env = os.environ.get("GENKIT_TRUSTED_REPOS", "")
    patterns = [p for p in env.replace(",", " ").split() if p]
    listed = load_settings().get("trusted_repos", [])
    if not isinstance(listed, list) or not all(isinstance(p, str) for p in listed):
        raise ValueError("`trusted_repos` in genkit settings.json must be a list of strings like 'org/*'")
    return patterns + listed


def local_recipes_need_trust() -> bool:
    """True when ``GENKIT_TRUST_LOCAL_RECIPES=0`` or settings.json has ``"trust_local_recipes": false``."""
    env = os.environ.get("GENKIT_TRUST_LOCAL_RECIPES")
    if env is not None and env.strip().lower() in _FALSE:
        return True
    if env is not None and env.strip().lower() in _TRUE:
        return False
    return load_settings().get("trust_local_recipes", True) is False


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def hub_cache_dir() -> Path:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        return Path(os.path.expanduser(env))
    if os.environ.get("HF_HOME"):
        return Path(os.path.expanduser(os.environ["HF_HOME"])) / "hub"
    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    from huggingface_hub import constants

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        value = os.environ.get(name)
        if value is not None and value.strip():
            return value.strip().lower() in _TRUE
    return bool(constants.HF_HUB_OFFLINE)


def hub_retries() -> int:
    try:
        return max(1, int(os.environ.get("GENKIT_HUB_RETRIES", "3")))
    except ValueError as exc:
        raise ValueError("GENKIT_HUB_RETRIES must be a positive integer") from exc


def hub_timeout() -> float:
    try:
        return float(os.environ.get("GENKIT_HUB_TIMEOUT", "10"))
    except ValueError as exc:
        raise ValueError("GENKIT_HUB_TIMEOUT must be a number of seconds") from exc
