"""The plugin CLI through real subprocesses: ``genkit plugins``, ``genkit list``, ``genkit install``
and ``genkit uninstall``; broken packs, ``GENKIT_STRICT_PLUGINS``, the ``GENKIT_PLUGINS``
allowlist, the ``GENKIT_DISABLE_PLUGIN_AUTOLOAD`` kill switch, cached Hub recipes, lazy start.

Packs are discovered from PYTHONPATH folders (a pip ``--target`` install of the real packs, plus
hand-made distributions for the broken cases); the shared environment is never modified."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
from test_packs import REPO, install_packs

TORCH_FREE_CHECK = r'''
import contextlib, io, json, sys
from genkit.cli import main
out = {}
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    try:
        main(["--help"])
    except SystemExit as e:
        out["help_exit"] = e.code
out["help_mentions"] = [c for c in ("plugins", "list", "install", "uninstall") if c in buf.getvalue()]
out["torch_after_help"] = "torch" in sys.modules
with contextlib.redirect_stdout(io.StringIO()):
    out["plugins_rc"] = main(["plugins", "--json"])
out["torch_after_plugins"] = "torch" in sys.modules
with contextlib.redirect_stdout(io.StringIO()):
    out["list_rc"] = main(["list"])
out["torch_after_list"] = "torch" in sys.modules
print(json.dumps(out))
'''


def _env(*paths: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GENKIT_", "HF_"))}
    parts = [str(p) for p in paths] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["HF_HUB_OFFLINE"] = "1"
    env.update(extra)
    return env


def genkit_cli(*args: str, paths: tuple[Path, ...] = (), python: str = sys.executable,
               **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-m", "genkit", *args], check=False, env=_env(*paths, **extra), capture_output=True,
                          text=True, timeout=300, cwd=str(REPO))


def fake_pack(site: Path, dist: str, version: str, ep_name: str, module: str, source: str) -> None:
    """A minimal installed distribution: a module plus a dist-info with a ``genkit`` entry point."""
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[genkit]\n{ep_name} = {module}\n")


@pytest.fixture(scope="module")
def pack_site(tmp_path_factory):
    return install_packs(tmp_path_factory.mktemp("cli_packs"))


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory):
    site = tmp_path_factory.mktemp("broken_site")
    fake_pack(site, "broken-pack", "0.3", "broken", "broken_pack", 'raise RuntimeError("boom at import")\n')
    fake_pack(site, "dupe-pack", "0.2", "dupe", "dupe_pack", '''
        from genkit.hookspecs import hookimpl

        @hookimpl
        def register_strategies(register):
            register("dupe_ok", lambda *a, **k: None)
            register("greedy", lambda *a, **k: None)
    ''')
    return site


def _names(report: dict) -> list[str]:
    return sorted(p["name"] for p in report["plugins"])


def test_help_plugins_and_list_do_not_import_torch(pack_site):
    proc = subprocess.run([sys.executable, "-c", TORCH_FREE_CHECK], check=False, env=_env(pack_site), capture_output=True,
                          text=True, timeout=300, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["help_exit"] == 0
    assert out["help_mentions"] == ["plugins", "list", "install", "uninstall"]
    assert out["plugins_rc"] == 0 and out["list_rc"] == 0
    assert out["torch_after_help"] is False
    assert out["torch_after_plugins"] is False
    assert out["torch_after_list"] is False


def test_plugins_lists_packs_with_versions_hooks_items(pack_site):
    proc = genkit_cli("plugins", "--json", paths=(pack_site,))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    by_name = {p["name"]: p for p in report["plugins"]}
    assert _names(report) == ["builtin", "events", "sampling"]
    assert by_name["sampling"]["distribution"] == "genkit-sampling-pack"
    assert by_name["sampling"]["version"] == "0.1.0"
    assert by_name["sampling"]["hooks"] == ["register_strategies", "register_logits_processors"]
    assert by_name["sampling"]["items"] == {"strategy": ["mirostat"],
                                            "logits_processor": ["dry", "xtc"]}
    assert by_name["events"]["items"] == {"candidate_generator": ["ngram_corpus"], "streamer": ["jsonl"]}
    assert "assisted" in by_name["builtin"]["items"]["strategy"]
    assert by_name["builtin"]["items"]["candidate_generator"] == ["draft_model", "prompt_lookup", "universal_assisted"]
    assert report["failed"] == []
    text = genkit_cli("plugins", paths=(pack_site,)).stdout
    assert "sampling  (genkit-sampling-pack@0.1.0)" in text
    assert "  strategy: mirostat" in text


def test_broken_pack_is_reported_and_skipped(pack_site, broken_site):
    proc = genkit_cli("plugins", paths=(broken_site, pack_site))
    assert proc.returncode == 0, proc.stderr
    assert "FAILED broken: RuntimeError: boom at import" in proc.stdout
    assert ("FAILED dupe: PluginError: duplicate strategy name 'greedy': registered by built-in (builtin) and by "
            "dupe-pack@0.2 (dupe)") in proc.stdout
    assert "genkit plugin 'broken' failed to load and was skipped: RuntimeError: boom at import" in proc.stderr
    report = json.loads(genkit_cli("plugins", "--json", paths=(broken_site, pack_site)).stdout)
    assert _names(report) == ["builtin", "events", "sampling"]  # the others keep working
    assert {f["name"] for f in report["failed"]} == {"broken", "dupe"}
    # the half-registered pack was rolled back
    rows = json.loads(genkit_cli("list", "--json", "--kind", "strategy", paths=(broken_site, pack_site)).stdout)
    names = {r["name"]: r["origin"] for r in rows}
    assert "dupe_ok" not in names and names["greedy"] == "built-in" and names["mirostat"] == "genkit-sampling-pack@0.1.0"


def test_strict_mode_makes_a_broken_pack_fatal(pack_site, broken_site):
    proc = genkit_cli("plugins", paths=(broken_site, pack_site), GENKIT_STRICT_PLUGINS="1")
    assert proc.returncode == 2
    # packs are imported before any registers, so the import error is the first to surface
    assert "genkit: error: genkit plugin 'broken' failed to load: RuntimeError: boom at import" in proc.stderr
    proc = genkit_cli("plugins", paths=(broken_site, pack_site), GENKIT_STRICT_PLUGINS="1", GENKIT_PLUGINS="dupe")
    assert proc.returncode == 2
    assert ("genkit: error: genkit plugin 'dupe' failed to load: PluginError: duplicate strategy name 'greedy'"
            in proc.stderr)


def test_allowlist(pack_site, broken_site):
    paths = (broken_site, pack_site)
    report = json.loads(genkit_cli("plugins", "--json", paths=paths, GENKIT_PLUGINS="sampling").stdout)
    assert _names(report) == ["builtin", "sampling"] and report["failed"] == []
    # distribution names work too, and several entries are comma-separated
    report = json.loads(genkit_cli("plugins", "--json", paths=paths,
                                   GENKIT_PLUGINS="genkit-events-pack, broken").stdout)
    assert _names(report) == ["builtin", "events"]
    assert [f["name"] for f in report["failed"]] == ["broken"]
    # a broken pack left off the allowlist is never imported, so strict mode has nothing to fail on
    proc = genkit_cli("plugins", paths=paths, GENKIT_PLUGINS="sampling", GENKIT_STRICT_PLUGINS="1")
    assert proc.returncode == 0, proc.stderr


def test_kill_switch(pack_site, broken_site):
    proc = genkit_cli("plugins", "--json", paths=(broken_site, pack_site), GENKIT_DISABLE_PLUGIN_AUTOLOAD="1",
                      GENKIT_STRICT_PLUGINS="1")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert _names(report) == ["builtin"] and report["failed"] == []
    rows = json.loads(genkit_cli("list", "--json", paths=(pack_site,), GENKIT_DISABLE_PLUGIN_AUTOLOAD="1").stdout)
    assert {r["origin"] for r in rows} == {"built-in"}


def _cached_repo(hub: Path, repo: str, sha: str, files: dict[str, str], ref: str | None = "main") -> Path:
    base = hub / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / sha
    for rel, text in files.items():
        (snap / rel).parent.mkdir(parents=True, exist_ok=True)
        (snap / rel).write_text(text)
    if ref:
        (base / "refs").mkdir(parents=True, exist_ok=True)
        (base / "refs" / ref).write_text(sha)
    return snap


def test_list_shows_origins_and_cached_hub_recipes(pack_site, tmp_path):
    hub = tmp_path / "hub"
    marker = tmp_path / "imported.txt"
    code = f"open({str(marker)!r}, 'w').write('imported')\n\ndef generate(model, **kwargs):\n    return None\n"
    sha = "a" * 40
    _cached_repo(hub, "acme/dola-recipe", sha, {"custom_generate/generate.py": code, "README.md": "---\n---\n"})
    _cached_repo(hub, "acme/plain-model", "b" * 40, {"config.json": "{}"})
    _cached_repo(hub, "acme/detached", "c" * 40, {"custom_generate/generate.py": code}, ref=None)
    proc = genkit_cli("list", "--json", paths=(pack_site,), HF_HUB_CACHE=str(hub))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    origin = {(r["kind"], r["name"]): r["origin"] for r in rows}
    assert origin[("strategy", "greedy")] == "built-in"
    assert origin[("strategy", "assisted")] == "built-in"
    assert origin[("strategy", "mirostat")] == "genkit-sampling-pack@0.1.0"
    assert origin[("logits_processor", "dry")] == "genkit-sampling-pack@0.1.0"
    assert origin[("logits_processor", "top_k")] == "built-in"
    assert origin[("candidate_generator", "ngram_corpus")] == "genkit-events-pack@0.1.0"
    assert origin[("candidate_generator", "prompt_lookup")] == "built-in"
    assert origin[("streamer", "jsonl")] == "genkit-events-pack@0.1.0"
    recipes = [r for r in rows if r["kind"] == "recipe"]
    assert [r["name"] for r in recipes] == ["acme/detached", "acme/dola-recipe"]
    assert origin[("recipe", "acme/dola-recipe")] == f"cached Hub recipe acme/dola-recipe@main ({sha[:12]})"
    assert origin[("recipe", "acme/detached")] == f"cached Hub recipe acme/detached ({'c' * 12})"
    dry_row = next(r for r in rows if r["name"] == "dry")
    assert dry_row["fields"] == ["dry_multiplier", "dry_base", "dry_allowed_length", "dry_sequence_breakers",
                                 "dry_penalty_last_n"]
    assert not marker.exists()  # listing never imports recipe code
    # --cache-dir and --kind, human-readable
    text = genkit_cli("list", "--kind", "recipe", "--cache-dir", str(hub), paths=(pack_site,)).stdout
    assert "acme/dola-recipe" in text and "mirostat" not in text
    assert text.splitlines()[0].split() == ["KIND", "NAME", "ORIGIN", "DESCRIPTION"]


def test_install_dry_run_resolves_bundled_packs():
    proc = genkit_cli("install", "sampling", "--no-deps", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (f"$ {sys.executable} -m pip install --no-deps "
                                   f"{REPO / 'plugins' / 'genkit-sampling-pack'}")



def test_uninstall_removes_packs_only(pack_site):
    proc = genkit_cli("uninstall", "events", "--dry-run", paths=(pack_site,))
    assert proc.stdout.strip() == f"$ {sys.executable} -m pip uninstall -y genkit-events-pack"
    proc = genkit_cli("uninstall", "Genkit_Sampling.Pack", "--dry-run", paths=(pack_site,))  # pip's name rules
    assert proc.stdout.strip() == f"$ {sys.executable} -m pip uninstall -y genkit-sampling-pack"
    for name in ("genkit-lm", "Genkit_LM", "torch"):
        proc = genkit_cli("uninstall", name, "--dry-run")
        assert proc.returncode == 2 and f"refusing to uninstall {name!r}: genkit needs it" in proc.stderr
    # a dependency of genkit, or anything that is no pack: refused before pip runs (was: uninstalled;
    # --dry-run here so that a regression prints the command instead of breaking the environment)
    for name in ("numpy", "tokenizers", "no-such-dist"):
        proc = genkit_cli("uninstall", name, "events", "--dry-run", paths=(pack_site,))
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr == (f"genkit: error: refusing to uninstall {name!r}: it is not an installed genkit pack (a "
                               "distribution with a `genkit` entry point); installed packs: genkit-events-pack, "
                               "genkit-sampling-pack\n")


def test_install_and_uninstall_in_genkit_environment(tmp_path):
    """A throw-away environment that sees the shared packages: `genkit install` puts the pack into
    *that* environment (the one running genkit) and `genkit uninstall` removes it again."""
    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    py = env_dir / "bin" / "python"
    env_site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
    shared = sysconfig.get_paths()["purelib"]
    (env_site / "_shared_site.pth").write_text(f"import site; site.addsitedir({shared!r})\n")
    pack = tmp_path / "genkit-sampling-pack"
    shutil.copytree(REPO / "plugins" / "genkit-sampling-pack", pack,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))

    proc = genkit_cli("install", str(pack), "--no-deps", "--no-build-isolation", python=str(py))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"$ {py} -m pip install --no-deps --no-build-isolation {pack}" in proc.stdout
    assert list(env_site.glob("genkit_sampling_pack-0.1.0.dist-info"))
    report = json.loads(genkit_cli("plugins", "--json", python=str(py)).stdout)
    assert "sampling" in _names(report)

    proc = genkit_cli("uninstall", "genkit-sampling-pack", python=str(py))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not list(env_site.glob("genkit_sampling_pack*"))
    report = json.loads(genkit_cli("plugins", "--json", python=str(py)).stdout)
    assert "sampling" not in _names(report)
