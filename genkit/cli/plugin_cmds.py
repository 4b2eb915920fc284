"""``genkit plugins``, ``genkit list``, ``genkit install`` and ``genkit uninstall``.

Nothing here imports torch: listing reads the registry, whose items are ``"module:attr"`` strings
until used, and cached Hub recipes are found by looking at files, never by importing them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError

KIND_LABELS = {
    "strategy": "strategy",
    "logits_processor": "processor",
    "candidate_generator": "candidate generator",
    "streamer": "streamer",
    "watermark": "watermark",
    "scheduler": "scheduler",
}


def add_parser(subparsers: Any) -> None:
    """Add the four plugin sub-commands to the ``genkit`` parser."""
    p = subparsers.add_parser("plugins", help="list loaded plugins (built-ins and packs) and failed packs",
                              description="Show every loaded plugin with its distribution, version, hooks and "
                                          "items, and every pack that failed to load with its error.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plugins)

    p = subparsers.add_parser("list", help="list every strategy, processor, candidate generator, streamer, watermark and scheduler",
                              description="List every registered item with its origin: built-in, pack@version, "
                                          "or a Hub recipe found in the local Hugging Face cache.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--kind", choices=sorted(KIND_LABELS) + ["recipe"], help="only items of this kind")
    p.add_argument("--cache-dir", default=None,
                   help="Hugging Face hub cache to scan for recipes (default: huggingface_hub's cache)")
    p.set_defaults(func=cmd_list)

    p = subparsers.add_parser("install", help="pip-install a genkit pack into genkit's own environment",
                              description="Run `python -m pip install` with the Python that runs genkit. PACK is "
                                          "a path, a pip requirement, or the name of a pack bundled in plugins/ "
                                          "of a genkit source checkout (e.g. 'sampling').")
    p.add_argument("packs", nargs="+", metavar="PACK")
    p.add_argument("-U", "--upgrade", action="store_true", help="upgrade if already installed")
    p.add_argument("-e", "--editable", action="store_true", help="install a local pack in editable mode")
    p.add_argument("--no-deps", action="store_true", help="do not install dependencies")
    p.add_argument("--no-build-isolation", action="store_true", help="build with the packages already installed")
    p.add_argument("--dry-run", action="store_true", help="print the pip command without running it")
    p.set_defaults(func=cmd_install)

    p = subparsers.add_parser("uninstall", help="pip-uninstall a genkit pack from genkit's own environment",
                              description="Run `python -m pip uninstall -y` with the Python that runs genkit. PACK "
                                          "is an installed pack (a distribution with a `genkit` entry point) or the "
                                          "name of a bundled pack (e.g. 'sampling'); anything else is refused.")
    p.add_argument("packs", nargs="+", metavar="PACK")
    p.add_argument("--dry-run", action="store_true", help="print the pip command without running it")
    p.set_defaults(func=cmd_uninstall)


# -- plugins -----------------------------------------------------------------------------------

def plugins_report() -> dict[str, Any]:
    """Loaded plugins and failed packs, as plain data."""
    from ..plugins import get_registry

    reg = get_registry()
    plugins = []
    for name, info in reg.plugins.items():
        plugins.append({
            "name": name,
            "kind": info["kind"],
            "distribution": info["distribution"],
            "version": info["version"],
            "hooks": list(info["hooks"]),
            "items": {k: sorted(v) for k, v in info["items"].items()},
        })
    failed = [{"name": n, "error": e} for n, e in reg.failed.items()]
    return {"plugins": plugins, "failed": failed}


def cmd_plugins(args: argparse.Namespace) -> int:
    report = plugins_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for p in report["plugins"]:
        where = "built-in" if p["kind"] == "builtin" else (
            f"{p['distribution']}@{p['version']}" if p["distribution"] else p["kind"])
        print(f"{p['name']}  ({where})")
        print(f"  hooks: {', '.join(p['hooks']) or '-'}")
        for kind, names in p["items"].items():
            print(f"  {KIND_LABELS.get(kind, kind)}: {', '.join(names)}")
    for f in report["failed"]:
        print(f"FAILED {f['name']}: {f['error']}")
    return 0


# -- list ------------------------------------------------------------------------------------

def _origin_text(origin: Any) -> str:
    if origin.kind == "builtin":
        return "built-in"
    if origin.distribution:
        return f"{origin.distribution}@{origin.version}"
    return f"{origin.kind} ({origin.plugin})"


def hub_cache_dir() -> str:
    """The Hugging Face hub cache directory huggingface_hub would use."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def cached_recipes(cache_dir: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """Hub repos in the local cache with ``custom_generate/generate.py`` in a snapshot.

    Only the file layout is inspected; no recipe code is read or imported.
    """
    root = Path(cache_dir) if cache_dir is not None else Path(hub_cache_dir())
    found: list[dict[str, Any]] = []
    if not root.is_dir():
        return found
    for repo_dir in sorted(root.glob("models--*")):
        parts = repo_dir.name.split("--")[1:]
        if not parts:
            continue
        repo_id = "/".join(parts)
        snapshots = repo_dir / "snapshots"
        if not snapshots.is_dir():
            continue
        refs: dict[str, list[str]] = {}
        refs_dir = repo_dir / "refs"
        if refs_dir.is_dir():
            for ref in refs_dir.rglob("*"):
                if ref.is_file():
                    try:
                        sha = ref.read_text(encoding="utf-8").strip()
                    except OSError:
                        continue
                    refs.setdefault(sha, []).append(ref.relative_to(refs_dir).as_posix())
        for snap in sorted(snapshots.iterdir()):
            if (snap / "custom_generate" / "generate.py").is_file():
                found.append({"repo": repo_id, "revision": snap.name, "refs": sorted(refs.get(snap.name, [])),
                              "path": str(snap)})
    return found


def list_items(kind: str | None = None, cache_dir: str | None = None) -> list[dict[str, Any]]:
    """Every registered item (and cached Hub recipe) with its origin, as plain data."""
    from ..plugins import get_registry

    reg = get_registry()
    rows: list[dict[str, Any]] = []
    for k in KIND_LABELS:
        if kind not in (None, k):
            continue
        for name in sorted(reg.items[k]):
            item = reg.items[k][name]
            row = {"kind": k, "name": name, "origin": _origin_text(item.origin), "plugin": item.origin.plugin,
                   "description": item.description}
            fields = getattr(item, "fields", ())
            if fields:
                row["fields"] = [f.name for f in fields]
            rows.append(row)
    if kind in (None, "recipe"):
        for r in cached_recipes(cache_dir):
            ref = f"@{r['refs'][0]}" if r["refs"] else ""
            rows.append({"kind": "recipe", "name": r["repo"],
                         "origin": f"cached Hub recipe {r['repo']}{ref} ({r['revision'][:12]})",
                         "plugin": None, "description": f"custom_generate={r['repo']!r}", "path": r["path"]})
    return rows


def cmd_list(args: argparse.Namespace) -> int:
    rows = list_items(args.kind, args.cache_dir)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width_kind = max([len(KIND_LABELS.get(r["kind"], r["kind"])) for r in rows] + [4])
    width_name = max([len(r["name"]) for r in rows] + [4])
    width_origin = max([len(r["origin"]) for r in rows] + [6])
    print(f"{'KIND':<{width_kind}}  {'NAME':<{width_name}}  {'ORIGIN':<{width_origin}}  DESCRIPTION")
    for r in rows:
        label = KIND_LABELS.get(r["kind"], r["kind"])
        print(f"{label:<{width_kind}}  {r['name']:<{width_name}}  {r['origin']:<{width_origin}}  {r['description']}")
    from ..plugins import get_registry

    for name, error in get_registry().failed.items():
        print(f"FAILED {name}: {error}", file=sys.stderr)
    return 0


# -- install / uninstall ---------------------------------------------------------------------

def bundled_pack(name: str) -> Path | None:
    """``plugins/<name>`` or ``plugins/genkit-<name>-pack`` of a genkit source checkout, if any."""
    root = Path(__file__).resolve().parents[2] / "plugins"
    for candidate in (name, f"genkit-{name}-pack"):
        path = root / candidate
        if "/" not in candidate and (path / "pyproject.toml").is_file():
            return path
    return None


def _resolve_pack(spec: str) -> str:
    if os.path.exists(spec) or any(c in spec for c in "<>=!~[@ "):
        return spec
    bundled = bundled_pack(spec)
    return str(bundled) if bundled is not None else spec


def _run_pip(cmd: list[str], dry_run: bool) -> int:
    print("$ " + " ".join(cmd), flush=True)
    if dry_run:
        return 0
    return subprocess.call(cmd)


def cmd_install(args: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", "pip", "install"]
    if args.upgrade:
        cmd.append("--upgrade")
    if args.no_deps:
        cmd.append("--no-deps")
    if args.no_build_isolation:
        cmd.append("--no-build-isolation")
    for spec in args.packs:
        target = _resolve_pack(spec)
        if args.editable:
            if not os.path.isdir(target):
                raise ConfigError(f"--editable needs a local pack folder; {spec!r} is not one")
            cmd += ["-e", target]
        else:
            cmd.append(target)
    rc = _run_pip(cmd, args.dry_run)
    if rc == 0 and not args.dry_run:
        print("installed; `genkit plugins` shows what the pack registers")
    return rc


PROTECTED = {"genkit-lm", "genkit_lm", "pluggy", "torch"}


def installed_packs() -> dict[str, str]:
    """The installed genkit packs, distributions with an entry point in the ``genkit`` group, by
    their normalized name (the name as installed)."""
    from importlib import metadata

    from packaging.utils import canonicalize_name

    from ..plugins import ENTRY_POINT_GROUP

    packs = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and any(ep.group == ENTRY_POINT_GROUP for ep in dist.entry_points):
            packs[canonicalize_name(name)] = name
    return packs


def cmd_uninstall(args: argparse.Namespace) -> int:
    """``pip uninstall -y`` of packs only: anything else (numpy, tokenizers, ...) is one of genkit's
    own dependencies or unrelated to it, and is refused before pip runs (names compared as pip
    compares them, PEP 503)."""
    from packaging.utils import canonicalize_name

    names = []
    packs = installed_packs()
    for spec in args.packs:
        if canonicalize_name(spec) in {canonicalize_name(n) for n in PROTECTED}:
            raise ConfigError(f"refusing to uninstall {spec!r}: genkit needs it; `genkit uninstall` is for packs")
        bundled = bundled_pack(spec) if not os.path.exists(spec) else None
        name = bundled.name if bundled is not None else spec
        if canonicalize_name(name) not in packs:
            listed = ", ".join(sorted(packs.values())) or "none"
            raise ConfigError(f"refusing to uninstall {spec!r}: it is not an installed genkit pack (a distribution "
                              f"with a `genkit` entry point); installed packs: {listed}")
        names.append(packs[canonicalize_name(name)])
    return _run_pip([sys.executable, "-m", "pip", "uninstall", "-y", *names], args.dry_run)
