"""Lazy start: building the registry with both packs installed imports neither torch nor the
packs' torch modules; each module is imported the first time a generation needs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_packs import REPO, install_packs, pack_env

PROBE = r'''
import json, sys
HEAVY = ["torch", "genkit_sampling_pack.processors", "genkit_sampling_pack.mirostat", "genkit_events_pack.jsonl",
         "genkit_events_pack.ngram", "genkit.builtin_strategies.assisted", "genkit.builtin_strategies.candidates",
         "genkit.builtin_strategies.decoding"]
def loaded():
    return [m for m in HEAVY if m in sys.modules]
steps = {}
from genkit.plugins import get_registry
reg = get_registry()
steps["registry"] = loaded()
steps["plugins"] = sorted(reg.plugins)
import genkit
cfg = genkit.GenerationConfig(dry_multiplier=0.5, xtc_probability=0.2, mirostat_tau=4.0)
steps["config"] = loaded()
steps["mode"] = cfg.get_generation_mode()
steps["after_mode"] = loaded()
import torch
from genkit.models.tiny import tiny_llama
m = tiny_llama(0)
ids = torch.tensor([[1, 5, 9, 5, 9, 5]])
with torch.no_grad():
    genkit.generate(m, ids, max_new_tokens=3)
    steps["greedy"] = loaded()
    genkit.generate(m, ids, max_new_tokens=3, dry_multiplier=0.5)
    steps["dry"] = loaded()
    genkit.generate(m, ids, max_new_tokens=3, mirostat_tau=3.0)
    steps["mirostat"] = loaded()
    genkit.generate(m, ids, max_new_tokens=3, candidate_generator="ngram_corpus",
                    candidate_generator_kwargs={"corpus": [[5, 9, 5, 9]]})
    steps["ngram"] = loaded()
print("@@" + json.dumps(steps))
'''


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    site = install_packs(tmp_path_factory.mktemp("lazy_packs"))
    proc = subprocess.run([sys.executable, "-c", PROBE], check=False, env=pack_env(site), capture_output=True,
                          text=True, timeout=300, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("@@"))
    return json.loads(line[2:])


def test_discovery_and_config_import_no_torch(steps):
    assert steps["plugins"] == ["builtin", "events", "sampling"]
    assert steps["registry"] == []
    assert steps["config"] == []  # pack fields validate without importing their processors
    assert steps["mode"] == "mirostat"
    assert steps["after_mode"] == []  # selectors are torch-free too


def test_pack_modules_load_on_first_use(steps):
    assert "torch" in steps["greedy"] and "genkit.builtin_strategies.decoding" in steps["greedy"]
    # the processors module holds all of the pack's processor factories, so the first generation
    # that builds processors imports it; the strategy and the drafting modules wait for their use
    assert "genkit_sampling_pack.mirostat" not in steps["dry"]
    assert "genkit_sampling_pack.mirostat" in steps["mirostat"]
    assert "genkit_events_pack.ngram" not in steps["mirostat"]
    assert "genkit.builtin_strategies.assisted" not in steps["mirostat"]
    assert {"genkit_events_pack.ngram", "genkit.builtin_strategies.assisted"} <= set(steps["ngram"])
    assert "genkit_events_pack.jsonl" not in steps["ngram"]
