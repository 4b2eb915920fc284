"""Where a ``generation_config.json`` comes from and goes to: a local file or folder, or a Hub repo
(with transformers' loader options: ``subfolder``, ``proxies``, ``local_files_only``, ...), and
the upload behind ``GenerationConfig.save_pretrained(push_to_hub=True)``.

This module does not import torch; ``huggingface_hub`` is imported only for Hub work.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from ..errors import ConfigError, ConfigFileError, ModelLoadError

logger = logging.getLogger("genkit.config")

# options transformers' loaders accept that a generation config has no use for: ignored, never
# turned into config entries
IGNORED_LOADER_KWARGS = ("_from_auto", "_from_pipeline", "_commit_hash", "trust_remote_code", "resume_download",
                         "mirror", "user_agent", "local_dir", "code_revision")
# what save_pretrained(push_to_hub=True) passes on to the upload
PUSH_KWARGS = ("repo_id", "commit_message", "commit_description", "token", "private", "create_pr", "revision")


def read_config_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object in ``path``; a :class:`~genkit.errors.ConfigFileError` (a ``ConfigError`` and an
    ``OSError``, as transformers raises) naming the file when it is not one."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"{os.fspath(path)} is not valid JSON: {exc}") from exc
    except RecursionError:
        raise ConfigFileError(f"{os.fspath(path)} is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"{os.fspath(path)} must hold a JSON object of generation settings; "
                          f"got a {type(data).__name__}")
    return data


def resolve_config_file(
    name: str | os.PathLike[str],
    file_name: str | os.PathLike[str],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    force_download: bool = False,
    local_files_only: bool = False,
    token: str | bool | None = None,
    revision: str | None = None,
    **kwargs: Any,
) -> tuple[str, dict[str, Any]]:
    """The local path of the config file ``name`` names (a json file, a folder, or a Hub repo id),
    and the keyword arguments left for the config (loader options removed)."""
    subfolder = kwargs.pop("subfolder", "") or ""
    proxies = kwargs.pop("proxies", None)
    legacy_token = kwargs.pop("use_auth_token", None)
    if token is None:
        token = legacy_token
    ignored = sorted(k for k in IGNORED_LOADER_KWARGS if k in kwargs)
    for key in ignored:
        kwargs.pop(key)
    if ignored:
        logger.info("GenerationConfig.from_pretrained: loader options with no use here ignored: %s", ignored)
    src = os.fspath(name)
    file_name = os.fspath(file_name)
    if os.path.isfile(src):
        return src, kwargs
    if os.path.isdir(src):
        path = os.path.join(src, subfolder, file_name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found: the folder {src!r} has no {os.path.join(subfolder, file_name)}")
        return path, kwargs
    if src.startswith((".", "/", "~")) or src.count("/") > 1 or (os.sep != "/" and os.sep in src):
        raise FileNotFoundError(f"{src!r} is neither an existing file or folder nor a Hub repo id ('org/name')")
    from huggingface_hub import hf_hub_download

    from ..hubhttp import download_deadline, hub_timeout_of

    try:
        with download_deadline(f"the download of {file_name} of {src}", checked_proxies(proxies)) as headers:
            path = hf_hub_download(src, file_name, subfolder=subfolder or None, revision=revision,
                                   cache_dir=cache_dir, force_download=force_download, token=token,
                                   local_files_only=local_files_only, headers=headers)
    except Exception as exc:
        timeout = hub_timeout_of(exc)  # the Hub client may report it in an error of its own
        if timeout is None:
            raise
        raise ModelLoadError(f"could not fetch {file_name} of {src!r} from the Hub: the Hub was too slow: "
                             f"{timeout}") from exc
    return os.fspath(path), kwargs


def checked_proxies(proxies: Any) -> dict[str, str] | None:
    """``proxies`` in transformers' format (``{"http": "host:3128", "https://hostname": "host:4012"}``),
    for this download alone (:class:`genkit.hubhttp.ProxyRoutes`); a ``ConfigError`` when it is not one."""
    if not proxies:
        return None
    if not isinstance(proxies, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                for k, v in proxies.items()):
        raise ConfigError("`proxies` must be a dict of {protocol or 'protocol://host': proxy URL}, e.g. "
                          f"{{'https': 'http://proxy:3128'}}; got {proxies!r}")
    return proxies


def push_config_file(path: str, directory: str, **kwargs: Any) -> str:
    """Upload the config file at ``path`` to ``repo_id`` (default: the folder's name, in the
    namespace of the token's user, as transformers does); returns the repo id."""
    unknown = sorted(set(kwargs) - set(PUSH_KWARGS))
    if unknown:
        raise ConfigError(f"save_pretrained(push_to_hub=True) takes {', '.join(PUSH_KWARGS)}; got {', '.join(unknown)}")
    from huggingface_hub import HfApi

    repo_id = kwargs.get("repo_id") or os.path.basename(os.path.normpath(directory))
    api = HfApi(token=kwargs.get("token"))
    repo_id = api.create_repo(repo_id, exist_ok=True, private=kwargs.get("private")).repo_id
    api.upload_file(path_or_fileobj=path, path_in_repo=os.path.basename(path), repo_id=repo_id,
                    commit_message=kwargs.get("commit_message") or "Upload generation config",
                    commit_description=kwargs.get("commit_description"), revision=kwargs.get("revision"),
                    create_pr=bool(kwargs.get("create_pr", False)))
    logger.info("generation config pushed to %s", repo_id)
    return str(repo_id)
