"""The example packs in plugins/: each is pip-installed (into a private --target folder, never the
shared environment) and every item it registers is used end to end on the tiny model, in a
subprocess whose PYTHONPATH holds the installed packs so the entry points are discovered exactly
as after a real ``pip install``.

References are computed, not typed in: DRY against a brute-force re-implementation, XTC with
threshold 0 against greedy on negated logits, Mirostat with a tiny target surprise against greedy,
drafting against plain greedy decoding."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKS = ("genkit-sampling-pack", "genkit-events-pack")
MARK = "@@RESULT@@"


def install_packs(dest: Path, packs: tuple[str, ...] = PACKS) -> Path:
    """pip-install packs from plugins/ into ``dest/site`` (copied first so the tree stays clean)."""
    site = dest / "site"
    paths = []
    for pack in packs:
        src = dest / "src" / pack
        shutil.copytree(REPO / "plugins" / pack, src, ignore=shutil.ignore_patterns("build", "*.egg-info",
                                                                                    "__pycache__"))
        paths.append(str(src))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "--no-build-isolation", "--no-index", "--target", str(site), *paths],
                   check=True, capture_output=True, text=True)
    return site


def pack_env(site: Path | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENKIT_")}
    parts = [str(site)] if site is not None else []
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.update(extra)
    return env


def run_script(code: str, site: Path, **extra: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=False, env=pack_env(site, **extra),
                          capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(MARK))
    return json.loads(line[len(MARK):])


@pytest.fixture(scope="module")
def pack_site(tmp_path_factory):
    return install_packs(tmp_path_factory.mktemp("packs"))


def test_install_produces_entry_points(pack_site):
    eps = {}
    for dist in pack_site.glob("*.dist-info"):
        text = (dist / "entry_points.txt").read_text()
        eps[dist.name] = text
    assert "[genkit]\nsampling = genkit_sampling_pack" in eps["genkit_sampling_pack-0.1.0.dist-info"]
    assert "[genkit]\nevents = genkit_events_pack" in eps["genkit_events_pack-0.1.0.dist-info"]


# ---------------------------------------------------------------------------------------------
# sampling pack: dry, xtc, mirostat (+ the fields of all three)

SAMPLING_SCRIPT = r'''
import json, torch, genkit
from genkit.models.tiny import tiny_llama
from genkit.plugins import get_registry
from genkit.strategy.processing import LogitsProcessor
res = {}
reg = get_registry()
res["items"] = {k: sorted(n for n, it in v.items() if it.origin.plugin == "sampling") for k, v in reg.items.items()}
res["origins"] = sorted({str(it.origin) for v in reg.items.values() for it in v.values() if it.origin.plugin == "sampling"})

errs = {}
for key, bad in [("dry_multiplier", -1), ("dry_base", 1.0), ("dry_allowed_length", 0), ("dry_sequence_breakers", [-1]),
                 ("dry_penalty_last_n", -2), ("xtc_probability", 1.5), ("xtc_threshold", "x"), ("mirostat_tau", 0),
                 ("mirostat_eta", 2)]:
    try:
        genkit.GenerationConfig(**{key: bad}); errs[key] = None
    except ValueError as e:
        errs[key] = str(e)
from genkit.generation.api import merge_config

for typo in ("xtc_probabilty", "dry_multiplyer"):  # generate's keywords (a config keeps them as custom entries)
    try:
        merge_config(None, None, {typo: 0.5}); errs[typo] = None
    except ValueError as e:
        errs[typo] = str(e)
res["errors"] = errs
cfg = genkit.GenerationConfig(dry_multiplier=0.8, dry_base=2.0, dry_allowed_length=3, dry_sequence_breakers=[5, 6],
                              dry_penalty_last_n=64, xtc_probability=0.3, xtc_threshold=0.2, mirostat_tau=4.0,
                              mirostat_eta=0.2)
res["roundtrip"] = genkit.GenerationConfig.from_dict(json.loads(cfg.to_json_string())) == cfg

# --- DRY against a brute-force reference ---
def ref_dry(ids, mult, base, allowed, breakers, last_n):
    if last_n == 0:
        return {}
    if last_n > 0:
        ids = ids[-last_n:]
    n, pen = len(ids), {}
    for t in set(ids):
        if t in breakers:
            continue
        best = 0
        for j in range(1, n):  # ids[j] == t continued the context that ended at j - 1
            if ids[j] != t:
                continue
            L = 0
            while L < j and L < 64:
                a, b = ids[j - 1 - L], ids[n - 1 - L]
                if a != b or a in breakers:
                    break
                L += 1
            best = max(best, L)
        if best >= allowed:
            pen[t] = mult * base ** (best - allowed)
    return pen

from genkit_sampling_pack.processors import DRYLogitsProcessor, XTCLogitsWarper
g = torch.Generator().manual_seed(0)
mismatch, penalised = 0, 0
for trial in range(30):
    V = 6
    ids = torch.randint(0, V, (3, 40), generator=g)
    params = dict(multiplier=0.7, base=1.6, allowed_length=1 + trial % 3, sequence_breakers=[5] if trial % 2 else [],
                  penalty_last_n=[-1, 25, 0][trial % 3])
    proc = DRYLogitsProcessor(**params)
    out = proc(ids, torch.zeros(3, V))
    for b in range(3):
        ref = ref_dry(ids[b].tolist(), params["multiplier"], params["base"], params["allowed_length"],
                      set(params["sequence_breakers"]), params["penalty_last_n"])
        expect = torch.zeros(V)
        for t, p in ref.items():
            expect[t] = -p
        penalised += len(ref)
        mismatch += int(not torch.allclose(out[b], expect, atol=1e-5))
res["dry_mismatch"], res["dry_penalised"] = mismatch, penalised

class RefDRY(LogitsProcessor):
    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for b, row in enumerate(input_ids.tolist()):
            for t, p in ref_dry(row, 1.5, 1.75, 1, {7}, -1).items():
                scores[b, t] -= p
        return scores

m = tiny_llama(0)
gen = torch.Generator().manual_seed(5)
base_ids = torch.randint(3, 128, (1, 8), generator=gen)
ids = torch.cat([base_ids, base_ids, base_ids[:, :4]], 1)
with torch.no_grad():
    greedy = genkit.generate(m, ids, max_new_tokens=40)
    dry = genkit.generate(m, ids, max_new_tokens=40, dry_multiplier=1.5, dry_allowed_length=1,
                          dry_sequence_breakers=[7])
    ref = genkit.generate(m, ids, max_new_tokens=40, logits_processor=[RefDRY()])
res["dry_e2e_equal_ref"] = torch.equal(dry, ref)
res["dry_changes_output"] = not torch.equal(dry, greedy)

# --- XTC ---
x = XTCLogitsWarper(1.0, 0.1)
s = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
res["xtc_unit"] = x(None, s.clone()).tolist()
one_top = torch.tensor([[0.8, 0.06, 0.06, 0.08]]).log()
res["xtc_single_top_unchanged"] = torch.equal(x(None, one_top.clone()), one_top)
res["xtc_p0_unchanged"] = torch.equal(XTCLogitsWarper(0.0, 0.1)(None, s.clone()), s)

class Negate(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return -scores

with torch.no_grad():
    xtc = genkit.generate(m, ids, max_new_tokens=15, do_sample=True, top_k=0, xtc_probability=1.0, xtc_threshold=0.0)
    argmin = genkit.generate(m, ids, max_new_tokens=15, logits_processor=[Negate()])
    xtc_greedy = genkit.generate(m, ids, max_new_tokens=15, xtc_probability=1.0)
res["xtc_e2e_is_argmin"] = torch.equal(xtc, argmin)
res["xtc_off_when_greedy"] = torch.equal(xtc_greedy, greedy[:, :xtc_greedy.shape[1]])

# --- Mirostat ---
res["mode"] = genkit.GenerationConfig(mirostat_tau=3.0).get_generation_mode()
res["mode_plain"] = genkit.GenerationConfig().get_generation_mode()
pad = torch.tensor([[0, 0, 0, 11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26, 27, 28]])
mask = (torch.arange(8)[None] >= torch.tensor([[3], [0]])).long()
with torch.no_grad():
    tiny_tau = genkit.generate(m, pad, attention_mask=mask, max_new_tokens=12, mirostat_tau=0.001, mirostat_eta=0.1)
    greedy_pad = genkit.generate(m, pad, attention_mask=mask, max_new_tokens=12)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(genkit.generate(m, ids, max_new_tokens=20, custom_generate="mirostat").tolist())
    torch.manual_seed(7)
    selected = genkit.generate(m, ids, max_new_tokens=20, mirostat_tau=5.0, return_dict_in_generate=True,
                               output_scores=True)
res["mirostat_tiny_tau_is_greedy"] = torch.equal(tiny_tau, greedy_pad)
res["mirostat_reproducible"] = runs[0] == runs[1]
res["mirostat_len"] = len(runs[0][0]) - ids.shape[1]
res["mirostat_selector_equals_name"] = selected.sequences.tolist() == runs[0]
res["mirostat_scores"] = len(selected.scores)
# a passed cache that holds a prefix of the (left-padded) prompt: only the rest is fed
import copy
prompt_cache = m.new_cache()
with torch.no_grad():
    m(pad[:, :5], attention_mask=mask[:, :5], past_key_values=prompt_cache)
    try:
        cached = genkit.generate(m, pad, attention_mask=mask, past_key_values=copy.deepcopy(prompt_cache),
                                 max_new_tokens=12, mirostat_tau=0.001, mirostat_eta=0.1)
        res["mirostat_prompt_cache_is_greedy"] = torch.equal(cached, greedy_pad)
    except RuntimeError as e:
        res["mirostat_prompt_cache_is_greedy"] = repr(e)

from genkit_sampling_pack.mirostat import mirostat_step
torch.manual_seed(0)
ranks = torch.arange(1, 501).float()
scores = (-1.1 * ranks.log())[None]
means = {}
for tau in (2.0, 4.0):
    mu, seen = torch.tensor([2 * tau]), []
    for i in range(2500):
        tok, mu, tr = mirostat_step(scores, mu, tau, 0.1)
        seen.append(float(-torch.log2(torch.softmax(tr, -1)[0, tok])))
    means[str(tau)] = sum(seen[500:]) / 2000
res["mirostat_mean_surprise"] = means
print("@@RESULT@@" + json.dumps(res))
'''


@pytest.fixture(scope="module")
def sampling_results(pack_site):
    return run_script(SAMPLING_SCRIPT, pack_site)


def test_sampling_pack_registers_with_origin(sampling_results):
    r = sampling_results
    assert r["items"]["strategy"] == ["mirostat"]
    assert r["items"]["logits_processor"] == ["dry", "xtc"]
    assert r["origins"] == ["genkit-sampling-pack@0.1.0 (sampling)"]


def test_sampling_pack_fields_are_validated(sampling_results):
    e = sampling_results["errors"]
    assert e["dry_multiplier"] == "`dry_multiplier` must be a number >= 0 (0 disables DRY); got -1."
    assert e["dry_base"] == "`dry_base` must be a number > 1; got 1.0."
    assert e["dry_allowed_length"].startswith("`dry_allowed_length` must be an int >= 1")
    assert e["dry_sequence_breakers"].startswith("`dry_sequence_breakers` must be a list of token ids >= 0")
    assert e["dry_penalty_last_n"].startswith("`dry_penalty_last_n` must be an int >= -1")
    assert e["xtc_probability"].startswith("`xtc_probability` must be a number in [0, 1]")
    assert e["xtc_threshold"].startswith("`xtc_threshold` must be a number in [0, 1]")
    assert e["mirostat_tau"].startswith("`mirostat_tau` must be a number > 0")
    assert e["mirostat_eta"].startswith("`mirostat_eta` must be a number in (0, 1]")
    assert "Did you mean `xtc_probability`?" in e["xtc_probabilty"]
    assert "Did you mean `dry_multiplier`?" in e["dry_multiplyer"]
    assert sampling_results["roundtrip"] is True


def test_dry_matches_reference(sampling_results):
    r = sampling_results
    assert r["dry_mismatch"] == 0
    assert r["dry_penalised"] > 20  # the random sequences did trigger penalties
    assert r["dry_e2e_equal_ref"] is True
    assert r["dry_changes_output"] is True


def test_xtc(sampling_results):
    r = sampling_results
    unit = r["xtc_unit"][0]
    assert unit[0] == float("-inf") and unit[1] == float("-inf")
    assert unit[2] == pytest.approx(__import__("math").log(0.15), rel=1e-5)
    assert unit[3] == pytest.approx(__import__("math").log(0.05), rel=1e-5)
    assert r["xtc_single_top_unchanged"] and r["xtc_p0_unchanged"]
    assert r["xtc_e2e_is_argmin"] is True
    assert r["xtc_off_when_greedy"] is True


def test_mirostat_strategy(sampling_results):
    r = sampling_results
    assert r["mode"] == "mirostat" and r["mode_plain"] == "greedy_search"
    assert r["mirostat_tiny_tau_is_greedy"] is True
    assert r["mirostat_reproducible"] is True and r["mirostat_len"] == 20
    assert r["mirostat_selector_equals_name"] is True and r["mirostat_scores"] == 20
    assert r["mirostat_prompt_cache_is_greedy"] is True
    for tau, mean in r["mirostat_mean_surprise"].items():
        assert abs(mean - float(tau)) < 0.2, (tau, mean)


# ---------------------------------------------------------------------------------------------
# events pack: jsonl streamer, ngram_corpus candidate generator

EVENTS_SCRIPT = r'''
import contextlib, io, json, os, tempfile, torch, genkit
from genkit.models.tiny import tiny_llama
from genkit.plugins import get_registry
res = {}
reg = get_registry()
res["items"] = {k: sorted(n for n, it in v.items() if it.origin.plugin == "events") for k, v in reg.items.items()}
res["origins"] = sorted({str(it.origin) for v in reg.items.values() for it in v.values() if it.origin.plugin == "events"})

class CharTok:
    """A character-level tokenizer for the tiny model's 128-token vocabulary."""
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 125 + 3 for c in text]
    def decode(self, ids):
        return "".join(chr(i) for i in ids)

m = tiny_llama(0)
gen = torch.Generator().manual_seed(3)
base = torch.randint(3, 128, (1, 8), generator=gen)
ids = torch.cat([base, base, base[:, :4]], 1)
tmp = tempfile.mkdtemp()
path = os.path.join(tmp, "events.jsonl")
os.environ["GENKIT_JSONL_PATH"] = path
with torch.no_grad():
    greedy = genkit.generate(m, ids, max_new_tokens=16)
    out = genkit.generate(m, ids, max_new_tokens=16, streamer="jsonl", tokenizer=CharTok())
    assisted = genkit.generate(m, ids, max_new_tokens=16, streamer="jsonl", prompt_lookup_num_tokens=4)
events = [json.loads(l) for l in open(path)]
res["same_output"] = torch.equal(out, greedy) and torch.equal(assisted, greedy)
res["new_tokens"] = out[0, ids.shape[1]:].tolist()
res["events"] = events
del os.environ["GENKIT_JSONL_PATH"]
buf = io.StringIO()
with contextlib.redirect_stdout(buf), torch.no_grad():
    genkit.generate(m, ids, max_new_tokens=3, streamer="jsonl")
res["stdout_events"] = [json.loads(l)["event"] for l in buf.getvalue().splitlines()]

# ngram_corpus: a corpus holding the greedy continuation drafts it perfectly
class Counter:
    def __init__(self, model):
        self.calls = 0
        self.h = model.register_forward_hook(self.hook)
    def hook(self, *a):
        self.calls += 1

cont = greedy[0].tolist()
with torch.no_grad():
    c = Counter(m)
    good = genkit.generate(m, ids, max_new_tokens=16, candidate_generator="ngram_corpus",
                           candidate_generator_kwargs={"corpus": [[9, 9, 9], cont], "num_tokens": 8,
                                                       "max_ngram_size": 3})
    c.h.remove()
    res["ngram_calls"] = c.calls
    junk = genkit.generate(m, ids, max_new_tokens=16, candidate_generator="ngram_corpus",
                           candidate_generator_kwargs={"corpus": [[int(t) for t in torch.randint(3, 128, (200,), generator=gen)]]})
    text = "".join(chr((t - 3) % 125) for t in cont)  # a text the char tokenizer encodes back to `cont`
    res["text_roundtrip"] = CharTok().encode(text) == [((ord(ch) % 125) + 3) for ch in text]
    by_text = genkit.generate(m, ids, max_new_tokens=16, candidate_generator="ngram_corpus",
                              candidate_generator_kwargs={"corpus": [text], "tokenizer": CharTok()})
    c = Counter(m)
    by_generate_tokenizer = genkit.generate(m, ids, max_new_tokens=16, candidate_generator="ngram_corpus",
                                            tokenizer=CharTok(),  # generate's own tokenizer= encodes the texts
                                            candidate_generator_kwargs={"corpus": [text], "num_tokens": 8})
    c.h.remove()
    res["ngram_generate_tokenizer_calls"] = c.calls
    jl = os.path.join(tmp, "corpus.jsonl")
    with open(jl, "w") as fh:
        fh.write(json.dumps([5, 6, 7]) + "\n" + json.dumps(cont) + "\n")
    by_file = genkit.generate(m, ids, max_new_tokens=16, candidate_generator="ngram_corpus",
                              candidate_generator_kwargs={"corpus_file": jl})
res["ngram_equal"] = [torch.equal(x, greedy) for x in (good, junk, by_text, by_file, by_generate_tokenizer)]
errs = {}
for kw in ({"corpus": [[1, 2]], "bogus": 1}, {}, {"corpus": ["text"]}, {"corpus": [[1, 2]], "num_tokens": 0},
           {"corpus_file": os.path.join(tmp, "missing.txt")}):
    try:
        with torch.no_grad():
            genkit.generate(m, ids, max_new_tokens=2, candidate_generator="ngram_corpus", candidate_generator_kwargs=kw)
        errs[json.dumps(kw)] = None
    except (ValueError, FileNotFoundError) as e:
        errs[json.dumps(kw)] = str(e)
res["errors"] = list(errs.values())
print("@@RESULT@@" + json.dumps(res))
'''


@pytest.fixture(scope="module")
def events_results(pack_site):
    return run_script(EVENTS_SCRIPT, pack_site)


def test_events_pack_registers_with_origin(events_results):
    r = events_results
    assert r["items"]["streamer"] == ["jsonl"]
    assert r["items"]["candidate_generator"] == ["ngram_corpus"]
    assert r["origins"] == ["genkit-events-pack@0.1.0 (events)"]


def test_jsonl_streamer_by_name(events_results):
    r = events_results
    assert r["same_output"] is True
    ev = r["events"]
    # two generations appended to the same file: prompt, 16 tokens, end — twice
    assert [e["event"] for e in ev] == (["prompt"] + ["token"] * 16 + ["end"]) * 2
    first, second = ev[:18], ev[18:]
    assert first[0] == {"event": "prompt", "batch": 1, "length": 20, "t": 0.0}
    for run in (first, second):
        tokens = run[1:-1]
        assert [e["token_id"] for e in tokens] == r["new_tokens"]
        assert [e["index"] for e in tokens] == list(range(16))
        ts = [e["t"] for e in tokens]
        assert ts == sorted(ts) and all(e["dt"] >= 0 for e in tokens)
        assert run[-1]["tokens"] == 16 and run[-1]["elapsed"] >= ts[-1] and run[-1]["ttft"] == ts[0]
    assert [e["text"] for e in first[1:-1]] == [chr(t) for t in r["new_tokens"]]
    assert "text" not in second[1]
    assert r["stdout_events"] == ["prompt", "token", "token", "token", "end"]


def test_ngram_corpus_drafting(events_results):
    r = events_results
    assert r["ngram_equal"] == [True, True, True, True, True]
    assert r["ngram_calls"] <= 4  # 16 tokens drafted 8 at a time from the corpus: few target passes
    # a text corpus encoded with the tokenizer= given to generate() drafts as well as token ids do
    assert r["ngram_generate_tokenizer_calls"] <= 4
    assert r["text_roundtrip"] is True
    e = r["errors"]
    assert e[0] == ("unknown `candidate_generator_kwargs` for ngram_corpus: ['bogus']; accepted: corpus, "
                    "corpus_file, tokenizer, num_tokens, max_ngram_size, min_ngram_size")
    assert e[1] == "ngram_corpus needs exactly one of `corpus` or `corpus_file` in candidate_generator_kwargs"
    assert e[2].startswith("a text `corpus` needs `tokenizer`")
    assert e[3] == "ngram_corpus `num_tokens` must be an int >= 1; got 0"
    assert e[4].startswith("`corpus_file` ") and e[4].endswith("does not exist")
