"""User settings for recipes and the Hub client, read at call time (not at import).

* ``GENKIT_HOME`` (default ``~/.cache/genkit``): holds ``settings.json``, manifests and locks.
* ``settings.json``: ``{"trusted_repos": ["org/*", "me/recipe@<sha>"], "trust_local_recipes": true}``.
* ``GENKIT_TRUSTED_REPOS``: comma/space separated patterns added to the file's list.
* ``GENKIT_TRUST_LOCAL_RECIPES=0``: local recipe folders need ``trust_remote_code=True`` too.
* ``GENKIT_HUB_RETRIES`` (3) and ``GENKIT_HUB_TIMEOUT`` (10 s per read; 6x that for a whole answer,
  headers included): Hub request policy. ``GENKIT_RECIPE_FETCH_TIMEOUT`` (300 s) bounds all Hub
  traffic of one recipe load. (``GENKIT_HUB_TIMEOUT`` and the model download's limit are read by
  :mod:`genkit.hubhttp`.)
* Hub client: ``HF_ENDPOINT``, ``HF_HUB_CACHE`` / ``HF_HOME``, ``HF_HUB_OFFLINE`` — read from the
  environment on every call, falling back to ``huggingface_hub.constants``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..hubhttp import hub_timeout, seconds_setting

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
        raise ConfigError(f"cannot read genkit settings {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"genkit settings {path} must hold a JSON object")  # noqa: TRY004
    return data


_PATTERN_PART = r"[A-Za-z0-9._*?\[\]!-]+"
_TRUSTED_PATTERN = re.compile(rf"({_PATTERN_PART})/({_PATTERN_PART})(?:@([0-9a-f]{{40}}))?")
_PATTERN_RULE = ("'org/name' (globs like 'org/*' allowed) or 'org/name@<40-hex commit sha>' (that commit only); "
                 "an empty or partial pin like 'org/name@' is refused")


def _checked_patterns(patterns: list[str], where: str) -> list[str]:
    for pattern in patterns:
        match = _TRUSTED_PATTERN.fullmatch(pattern)
        if not match or match.group(1) == "*" and match.group(2) == "*":
            raise ConfigError(f"{where}: trusted-repos entry {pattern!r} is not accepted; each entry is {_PATTERN_RULE}"
                              + ("; '*/*' would trust every repo" if match else ""))
    return patterns


def trusted_repos() -> list[str]:
    """Trusted-repo patterns from ``GENKIT_TRUSTED_REPOS`` and ``settings.json`` (``org/*``, ``org/repo``,
    ``org/repo@<sha>``). Any other entry is an error naming where it came from (fail closed)."""
    env = os.environ.get("GENKIT_TRUSTED_REPOS", "")
    patterns = _checked_patterns([p for p in env.replace(",", " ").split() if p], "GENKIT_TRUSTED_REPOS")
    listed = load_settings().get("trusted_repos", [])
    where = f"`trusted_repos` in {genkit_home() / 'settings.json'}"
    if not isinstance(listed, list) or not all(isinstance(p, str) for p in listed):
        raise ConfigError(f"{where} must be a list of strings, each {_PATTERN_RULE}")
    return patterns + _checked_patterns(listed, where)


def local_recipes_need_trust() -> bool:
    """True when ``GENKIT_TRUST_LOCAL_RECIPES`` is false (0/false/no/off) or settings.json has
    ``"trust_local_recipes": false``. Any other value is an error naming the setting (fail closed)."""
    env = os.environ.get("GENKIT_TRUST_LOCAL_RECIPES")
    if env is not None:
        value = env.strip().lower()
        if value in _FALSE:
            return True
        if value in _TRUE:
            return False
        raise ConfigError(f"GENKIT_TRUST_LOCAL_RECIPES={env!r} is not accepted; use one of "
                          f"{', '.join(sorted(_TRUE))} (trust local recipe folders) or {', '.join(sorted(_FALSE))} "
                          "(they need trust_remote_code=True)")
    setting = load_settings().get("trust_local_recipes", True)
    if not isinstance(setting, bool):
        raise ConfigError(f"`trust_local_recipes` in {genkit_home() / 'settings.json'} must be true or false; "
                          f"got {setting!r}")
    return setting is False


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
    """Attempts of one Hub request (``GENKIT_HUB_RETRIES``, default 3): an integer >= 1."""
    raw = os.environ.get("GENKIT_HUB_RETRIES", "3")
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"GENKIT_HUB_RETRIES={raw!r} is not accepted; use a whole number of attempts >= 1")
    return value


def recipe_fetch_timeout() -> float:
    """Seconds of Hub traffic one recipe load (or ``genkit inspect`` / ``check``) may take in all,
    every request and retry included (``GENKIT_RECIPE_FETCH_TIMEOUT``, default 300)."""
    return seconds_setting("GENKIT_RECIPE_FETCH_TIMEOUT", "300")


__all__ = ["genkit_home", "hub_cache_dir", "hub_endpoint", "hub_offline", "hub_retries", "hub_timeout",
           "load_settings", "local_recipes_need_trust", "recipe_fetch_timeout", "trusted_repos"]
