"""Step 2: the trust gate. Runs before any recipe file is requested or written."""

from __future__ import annotations

import fnmatch

from ..errors import ConfigError
from .errors import RecipeTrustError
from .resolve import RecipeRef
from .settings import genkit_home, local_recipes_need_trust, trusted_repos


def matching_pattern(repo_id: str, commit: str | None) -> str | None:
    """The first trusted-repos pattern that covers ``repo_id`` (at ``commit``), or None.

    Patterns: ``org/*`` (globs), ``org/repo``, ``org/repo@<sha>`` (only that commit)."""
    for pattern in trusted_repos():
        name, _, pinned = pattern.partition("@")
        if not fnmatch.fnmatchcase(repo_id, name):
            continue
        if pinned and pinned != commit:
            continue
        return pattern
    return None


def check_flag(trust_remote_code: object) -> None:
    """``trust_remote_code`` is True, False or None (a string such as ``"false"`` is an error, before
    any request)."""
    if trust_remote_code is not None and not isinstance(trust_remote_code, bool):
        raise ConfigError(f"`trust_remote_code` must be True, False or None; got {trust_remote_code!r}")


def could_be_trusted(ref: RecipeRef, trust_remote_code: bool | None) -> bool:
    """Whether trust is possible before the commit is known (so an untrusted Hub recipe is refused
    without a single request): the flag is True, or a trusted-repos pattern names the repo."""
    check_flag(trust_remote_code)
    if trust_remote_code is True or ref.kind == "local":
        return True
    if trust_remote_code is False:
        return False
    return any(fnmatch.fnmatchcase(ref.repo_id or "", p.partition("@")[0]) for p in trusted_repos())


def check_trust(ref: RecipeRef, commit: str | None, trust_remote_code: bool | None) -> str:
    """Return why the recipe may run, or raise :class:`RecipeTrustError` saying how to give trust."""
    check_flag(trust_remote_code)
    if ref.kind == "local":
        if trust_remote_code is False:
            raise RecipeTrustError(f"trust_remote_code=False forbids running the local recipe {ref.ref!r}; pass "
                                   "trust_remote_code=True (or leave it unset) to run it")
        if trust_remote_code is True:
            return "trust_remote_code=True"
        if local_recipes_need_trust():
            raise RecipeTrustError(
                f"local recipe {ref.ref!r} was not run: local recipes need trust_remote_code=True because "
                "GENKIT_TRUST_LOCAL_RECIPES=0 or \"trust_local_recipes\": false is set in "
                f"{genkit_home() / 'settings.json'}. Read its custom_generate/ code, then pass trust_remote_code=True."
            )
        return "local folder"
    if trust_remote_code is True:
        return "trust_remote_code=True"
    pattern = None if trust_remote_code is False else matching_pattern(ref.repo_id or "", commit)
    if pattern:
        return f"trusted-repos entry {pattern!r}"
    pin = f"{ref.repo_id}@{commit}" if commit else f"{ref.repo_id}@<sha>"
    raise RecipeTrustError(
        f"the Hub recipe {ref.ref!r}{f' (commit {commit})' if commit else ''} runs Python code from that repo on this machine, so it "
        "needs your explicit trust. Read it first (`genkit inspect " + ref.ref + "`), then either pass "
        f"trust_remote_code=True, or add the repo to your trusted repos: GENKIT_TRUSTED_REPOS='{ref.repo_id}' "
        f"(globs like '{(ref.repo_id or 'org/x').split('/')[0]}/*' work; '{pin}' trusts only this commit) or "
        f"\"trusted_repos\" in {genkit_home() / 'settings.json'}. No recipe file was downloaded."
    )
