"""issue 32 item 1, the per-CPU kernel choice (genkit/models/kernel_choice.py): every path this CPU
has, forced with GENKIT_KERNEL, gives the same greedy tokens as the model's modules (dense) or as each
other (the block kernel's paths); the probe's choice is cached, a tampered cache is refused, the
environment variable wins over the cache, and `genkit info` shows the choice and its reason."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from test_quantized import write_quantized_gguf

import genkit
from genkit import threads
from genkit.cli import main as cli_main
from genkit.errors import ConfigError
from genkit.models import block_kernel, cpu, dense_kernel, kernel_choice
from genkit.models.llama_infer import packing_available
from genkit.models.tiny import tiny_llama

block_kernel.available()  # built (or loaded) under the usual GENKIT_HOME before the tests move it

PROMPTS = {"decode": [[1, 17, 33, 5, 60, 9]], "small": [[1, 17, 33, 5], [3, 44, 45, 46], [8, 8, 9, 10], [2, 9, 7, 7]],
           "prefill": [list(range(3, 43))]}
DENSE_FORCED = {"packed": "packed", "plain": "plain", "mixed": "decode:plain,small:packed,prefill:packed",
                "mixed2": "decode:packed,small:plain,prefill:plain", "gemv": "gemv",
                "gemv-decode": "decode:gemv,small:gemv,prefill:plain"}


def _load(monkeypatch, load: float, folder: Path) -> None:
    """The machine's load as the probe sees it (the busy rule's inputs): the 1-minute load average
    (os.getloadavg) and, in a stand-in for /proc/loadavg, as many threads runnable elsewhere."""
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    with open(os.path.join(folder, "loadavg"), "w", encoding="ascii") as fh:  # this thread is runnable too
        fh.write(f"{load:.2f} {load:.2f} {load:.2f} {int(load) + 1}/900 4242\n")
    monkeypatch.setattr(threads, "LOADAVG", os.path.join(folder, "loadavg"))


@pytest.fixture(autouse=True)
def home(tmp_path, tmp_path_factory, monkeypatch) -> Path:
    monkeypatch.setenv("GENKIT_HOME", str(tmp_path))
    monkeypatch.delenv(kernel_choice.ENV, raising=False)
    _load(monkeypatch, 0.0, tmp_path_factory.mktemp("proc"))  # a quiet machine, so the probe runs (tests/test_kernel_choice.py::test_busy... below)
    kernel_choice.CHOSEN.clear()
    return tmp_path


def _greedy(model, prompt: list[list[int]], new: int = 8) -> list[list[int]]:
    out = model.generate(torch.tensor(prompt), max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, len(prompt[0]):].tolist()


def _module_greedy(model, prompt: list[list[int]], new: int = 8) -> list[list[int]]:
    """The reference: full forwards through the modules (autograd on: no inference path, no cache)."""
    ids = torch.tensor(prompt)
    with torch.enable_grad():
        for _ in range(new):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, len(prompt[0]):].tolist()


@pytest.mark.parametrize("name", sorted(DENSE_FORCED))
def test_a_forced_dense_path_gives_the_modules_greedy_tokens(name, monkeypatch):
    if "packed" in DENSE_FORCED[name] and not packing_available():
        pytest.skip("oneDNN cannot pack float32 weights on this CPU/build: only the plain path exists here")
    if "gemv" in DENSE_FORCED[name] and not dense_kernel.available():
        pytest.skip("no C compiler: genkit's gemv kernel does not exist here (tests/test_dense_kernel.py)")
    monkeypatch.setenv(kernel_choice.ENV, DENSE_FORCED[name])
    model = tiny_llama(seed=5)
    got = {cls: _greedy(model, prompt) for cls, prompt in PROMPTS.items()}
    routes = model._prepared[1].routes
    wanted = kernel_choice.parse_override(DENSE_FORCED[name])
    for cls in kernel_choice.CLASSES:
        assert routes[cls][0][0].packed is (wanted[cls] == "packed"), cls
        assert (type(routes[cls][0][0].wgu) is dense_kernel.Gemv) is (wanted[cls] == "gemv"), cls
    assert all("GENKIT_KERNEL" in why for why in model._prepared[1].choice.reasons.values())
    assert got == {cls: _module_greedy(model, prompt) for cls, prompt in PROMPTS.items()}


@pytest.fixture(scope="module")
def quantized_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("choice") / "q.gguf"
    write_quantized_gguf(path, "Q4_1")
    return path


def _block_paths() -> list[str]:
    if not block_kernel.available() or not block_kernel.simd():
        return []
    simd = "vnni" if block_kernel.simd() == "avx512-vnni" else "avx2"
    return [simd, "amx"] if block_kernel.amx_available() else [simd]


def test_every_block_kernel_path_here_gives_the_same_greedy_tokens(quantized_file, monkeypatch):
    paths = _block_paths()
    if not paths:
        pytest.skip("no C compiler or no vector path for the block kernel on this CPU")
    results, logits = {}, {}
    for path in paths:
        monkeypatch.setenv(kernel_choice.ENV, path)
        model = genkit.load_model(quantized_file)
        results[path] = {cls: _greedy(model, p) for cls, p in PROMPTS.items()}
        with torch.inference_mode():
            logits[path] = model(torch.tensor(PROMPTS["prefill"])).logits
        assert model._prepared[1].choice.paths == dict.fromkeys(kernel_choice.CLASSES, path)
    dense = genkit.load_model(quantized_file, dequantize=True)
    assert results[paths[0]] == {cls: _module_greedy(dense, p) for cls, p in PROMPTS.items()}
    for path in paths[1:]:  # AMX: the same integer sums, scaled in the same order as the VNNI path
        assert results[path] == results[paths[0]]
        assert torch.equal(logits[path], logits[paths[0]])


def _thresholds(model) -> set[int]:
    """The AMX thresholds a prepared quantized model's products run on: its block weights', its decoder
    entries' and its LM head's (the ends of its one-call steps)."""
    prepared = model._prepared[1]
    found = {w.amx_rows for p in prepared.layers for w in (p.wqkv, p.wo, p.wgu, p.wd)}
    found |= {entry.amx_rows for entry in prepared.decoder.table}
    return found | {model.lm_head.amx_rows} if hasattr(model.lm_head, "amx_rows") else found


def test_two_quantized_models_keep_their_own_amx_thresholds(quantized_file, monkeypatch):
    """Each model's products run on the AMX threshold its own kernel choice set: a model prepared
    later with another choice leaves it (before, one C variable for the process: the last model
    prepared moved every other model's prefill onto its path)."""
    if not block_kernel.available() or not block_kernel.amx_available():
        pytest.skip("this CPU (or kernel) has no AMX-INT8: every model's threshold is 0")
    simd = _block_paths()[0]
    monkeypatch.setenv(kernel_choice.ENV, f"decode:{simd},small:{simd},prefill:amx")
    tiles = genkit.load_model(quantized_file)
    first = _greedy(tiles, PROMPTS["prefill"])
    monkeypatch.setenv(kernel_choice.ENV, simd)
    vector = genkit.load_model(quantized_file)
    assert _greedy(vector, PROMPTS["prefill"]) == first
    assert _thresholds(tiles) == {block_kernel.AMX_PREFILL_MIN_ROWS} and _thresholds(vector) == {0}
    assert _greedy(tiles, PROMPTS["prefill"]) == first  # (the same bits on either path)
    assert _thresholds(tiles) == {block_kernel.AMX_PREFILL_MIN_ROWS}


def test_a_model_takes_the_choice_of_the_thread_count_it_runs_at(quantized_file):
    """The kernel choice is made per thread count: a model prepared at 1 thread is prepared again, with
    the choice for 2, when the process moves to 2 threads, and kept while the count stays (before, it
    kept its first choice: a benchmark at 1 then 2 threads ran its 2-thread prompts on the 1-thread
    choice, never probing the 2-thread one; session 36)."""
    if not _block_paths():
        pytest.skip("no C compiler or no vector path for the block kernel on this CPU")
    if threads.cpu_budget() < 2:
        pytest.skip("one CPU available: no second thread count to move to")
    model, before = genkit.load_model(quantized_file), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        first = _greedy(model, PROMPTS["prefill"])
        one = model._prepared[1]
        torch.set_num_threads(2)
        assert _greedy(model, PROMPTS["prefill"]) == first
        two = model._prepared[1]
        assert two is not one and model._prepared[0][1] == 2 and two.choice is not one.choice
        assert _greedy(model, PROMPTS["prefill"]) == first and model._prepared[1] is two
    finally:
        torch.set_num_threads(before)
    if len(_block_paths()) > 1:  # a probe at each count (the prefill class has two paths here)
        assert {key.split("|")[2] for key in kernel_choice.cached_entries()} == {"threads=1", "threads=2"}


def test_each_activation_rounding_has_its_own_choice_and_llama_order_no_tiles(quantized_file):
    """The block kernel's choice is made per activation rounding (AMX's gain over the vector path
    differs by it: one choice for both had a one-digit probe decide a two-digit model's prefill), and
    llama.cpp's float order, which never runs on AMX tiles, is not offered them (its probe would time the
    vector path twice)."""
    simd = _block_paths()[:1]
    if not simd:
        pytest.skip("no C compiler or no vector path for the block kernel on this CPU")
    for kwargs in ({}, {"activation_digits": 1}, {"numerics": "llama.cpp"}):
        _greedy(genkit.load_model(quantized_file, **kwargs), PROMPTS["prefill"])
    acts = {sig.rsplit(";", 1)[1]: choice for (family, sig), choice in kernel_choice.CHOSEN.items() if family == "blocks"}
    two, one = block_kernel.ACT_TWO, block_kernel.ACT_Q8_1
    assert set(acts) == {f"act{two}", f"act{one}", f"act{block_kernel.llama_order(one)}"}
    assert acts[f"act{block_kernel.llama_order(one)}"].paths == dict.fromkeys(kernel_choice.CLASSES, simd[0])
    assert set(acts[f"act{block_kernel.llama_order(one)}"].reasons.values()) == {"the only path here"}


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _runner(calls: list[tuple[str, int]], packed: float = 0.004, plain: float = 0.001):
    def run(path: str, rows: int) -> None:  # by default "plain" is 4x faster than the default "packed"
        calls.append((path, rows))
        _spin(packed if path == "packed" else plain)

    return run


def test_the_probe_choice_is_cached_and_verified(home):
    calls: list[tuple[str, int]] = []
    first = kernel_choice.choose("dense", "sig-a", ("packed", "plain"), _runner(calls))
    assert first.paths == dict.fromkeys(kernel_choice.CLASSES, "plain")
    assert all(why.startswith("probe at") for why in first.reasons.values())
    assert {rows for _, rows in calls} == set(kernel_choice.PROBE_ROWS.values())
    path = kernel_choice.cache_path()
    assert path.parent == home / "kernels" and path.with_name(path.name + ".sha256").is_file()
    assert path.stat().st_mode & 0o022 == 0
    calls.clear()
    again = kernel_choice.choose("dense", "sig-a", ("packed", "plain"), _runner(calls))
    assert calls == [] and again.paths == first.paths
    assert all(why.startswith("cached probe at") for why in again.reasons.values())


def test_amx_is_probed_only_where_it_runs(home):
    """The block kernel's AMX tiles run products of 16 rows or more only: the decode (1 row) and
    small (probed at 4) classes are not offered them (their probe would time the vector path twice
    and choose by noise); the prefill class probes both."""
    calls: list[tuple[str, int]] = []

    def run(path: str, rows: int) -> None:  # AMX 4x faster: it would win any probe it entered
        calls.append((path, rows))
        _spin(0.001 if path == "amx" else 0.004)

    choice = kernel_choice.choose("blocks", "sig-amx", ("vnni", "amx"), run)
    assert choice.paths == {"decode": "vnni", "small": "vnni", "prefill": "amx"}
    assert {rows for path, rows in calls if path == "amx"} == {kernel_choice.PROBE_ROWS["prefill"]}
    assert {rows for path, rows in calls if path == "vnni"} == {kernel_choice.PROBE_ROWS["prefill"]}
    for cls in ("decode", "small"):
        assert choice.reasons[cls] == "the only path here for this class (amx runs products of 16+ rows only)"
    assert choice.reasons["prefill"].startswith("probe at 64 rows")


def test_the_cache_key_covers_the_c_kernels_code(home):
    """A choice measured on one version of the block or dense kernel is not read for another: the
    cache file's key is a digest of the CPU, torch, genkit, the probe rule and both C sources."""
    models = Path(kernel_choice.__file__).parent
    sources = hashlib.sha256(b"".join((models / n).read_bytes() for n in ("block_kernel.c", "dense_kernel.c")))
    text = (f"{cpu.cache_key()}\0{torch.__version__}\0{genkit.__version__}\0"
            f"probe-v{kernel_choice.PROBE_VERSION}\0{sources.hexdigest()[:16]}")
    assert kernel_choice.cache_path().name == f"choice-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"


def test_a_tampered_cache_file_is_refused(home, caplog):
    kernel_choice.choose("dense", "sig-b", ("packed", "plain"), _runner([]))
    path = kernel_choice.cache_path()
    data = json.loads(path.read_text())
    for entry in data["entries"].values():
        entry["path"] = "packed"  # planted: would make every class run the slower path
    path.write_text(json.dumps(data))
    calls: list[tuple[str, int]] = []
    with caplog.at_level("WARNING", logger="genkit.models"):
        choice = kernel_choice.choose("dense", "sig-b", ("packed", "plain"), _runner(calls))
    assert "sha256 does not match" in caplog.text and str(path) in caplog.text
    assert calls and choice.paths == dict.fromkeys(kernel_choice.CLASSES, "plain")
    assert kernel_choice.cached_entries()  # probed again and written back, verified
    assert all(e["path"] == "plain" for e in kernel_choice.cached_entries().values())


def test_the_environment_variable_wins_over_the_cache(monkeypatch):
    kernel_choice.choose("dense", "sig-c", ("packed", "plain"), _runner([]))
    monkeypatch.setenv(kernel_choice.ENV, "decode:packed")
    calls: list[tuple[str, int]] = []
    choice = kernel_choice.choose("dense", "sig-c", ("packed", "plain"), _runner(calls))
    assert calls == []
    assert choice.paths == {"decode": "packed", "small": "plain", "prefill": "plain"}
    assert choice.reasons["decode"] == "GENKIT_KERNEL=decode:packed"
    assert choice.reasons["small"].startswith("cached")


@pytest.mark.parametrize("value", ["fast", "decode:", "batch:plain", "decode:plain,prefill:turbo"])
def test_a_malformed_override_is_an_error_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv(kernel_choice.ENV, value)
    with pytest.raises(ConfigError, match=r"GENKIT_KERNEL items are PATH or CLASS:PATH .*amx, avx2, gemv, packed, plain, vnni"):
        kernel_choice.choose("dense", "sig-d", ("packed", "plain"), _runner([]))


def test_a_path_this_cpu_lacks_is_refused(monkeypatch):
    monkeypatch.setenv(kernel_choice.ENV, "amx")
    with pytest.raises(ConfigError, match=r"GENKIT_KERNEL asks for 'amx' \(decode\), which this CPU or build does "
                                          r"not have; available here: avx2"):
        kernel_choice.choose("blocks", "sig-e", ("avx2",), _runner([]))


def test_genkit_info_prints_the_choice_and_why(capsys, monkeypatch):
    kernel_choice.choose("dense", "sig-f", ("packed", "plain"), _runner([]))
    monkeypatch.setattr(sys, "argv", ["genkit", "info"])
    assert cli_main(["info"]) == 0
    out = capsys.readouterr().out
    assert "cpu: " in out and "block kernel: " in out and str(kernel_choice.cache_path()) in out
    gpu = [line for line in out.splitlines() if line.startswith("gpu: ")]
    assert len(gpu) == 1
    if not torch.backends.cuda.is_built():
        assert gpu[0] == "gpu: none (this torch build has no CUDA support; --device cpu)"
    elif torch.cuda.is_available():
        assert gpu[0].startswith(f"gpu: cuda:0 {torch.cuda.get_device_name(0)}")
    else:
        assert gpu[0] == f"gpu: none visible (torch {torch.version.cuda} CUDA build; --device cpu)"
    for cls in kernel_choice.CLASSES:
        assert any(f"dense {cls}" in line and "plain" in line and "[sig-f] probe at" in line
                   for line in out.splitlines()), cls


def test_the_default_stays_unless_another_path_is_clearly_faster():
    ms = 1e-3
    close = {"packed": [10 * ms] * 5, "plain": [9.5 * ms] * 5}  # plain 5 % faster: below the 10 % margin
    assert kernel_choice.decide(close) == ("packed", "median of 5 rounds: packed 10.00 ms, plain 9.50 ms; "
                                                     "plain/packed 0.95 (below 0.90 replaces the default)")
    clear = {"packed": [10 * ms] * 5, "plain": [8.5 * ms] * 5}
    assert kernel_choice.decide(clear)[0] == "plain"
    # a load that doubles every round and one round spoiled by a preemption: the median of the per-round
    # ratios decides (plain is 0.8 of packed in every other round), not the totals ...
    spoiled = {"packed": [10 * ms, 20 * ms, 40 * ms, 80 * ms, 160 * ms],
               "plain": [8 * ms, 16 * ms, 320 * ms, 64 * ms, 128 * ms]}
    assert kernel_choice.decide(spoiled)[0] == "plain"
    # ... nor one lucky round (the minimum would elect amx)
    assert kernel_choice.decide({"vnni": [1.0, 1.0, 1.0], "amx": [1.2, 0.5, 1.2]})[0] == "vnni"


def test_a_preferred_path_wins_within_the_slack_of_a_faster_one():
    """Dense decode prefers gemv (its steps run in one call and greedy steps speculate, which the
    probe's unit does not time): within 0.15 of a faster path, or of the default when nothing beats
    it by the margin, not when further behind, and never when slower than the default."""
    assert kernel_choice.PREFERRED == {("dense", "decode"): "gemv"}
    close = {"packed": [10.0] * 5, "plain": [8.6] * 5, "gemv": [8.9] * 5}
    assert kernel_choice.decide(close)[0] == "plain"
    winner, why = kernel_choice.decide(close, "gemv")
    assert winner == "gemv" and why.endswith("plain/packed 0.86 (below 0.90 replaces the default); gemv (0.89) "
                                             "preferred within 0.15 of it")
    assert kernel_choice.decide({"packed": [10.0] * 5, "plain": [7.0] * 5, "gemv": [8.6] * 5}, "gemv")[0] == "plain"
    assert kernel_choice.decide({"packed": [10.0] * 5, "plain": [7.0] * 5, "gemv": [8.4] * 5}, "gemv")[0] == "gemv"
    assert kernel_choice.decide({"packed": [10.0] * 5, "plain": [9.2] * 5, "gemv": [9.3] * 5}, "gemv")[0] == "gemv"
    assert kernel_choice.decide({"packed": [10.0] * 5, "plain": [9.2] * 5, "gemv": [10.4] * 5}, "gemv")[0] == "packed"
    assert kernel_choice.decide({"packed": [10.0] * 5, "gemv": [9.99] * 5}, "gemv")[0] == "gemv"


def test_the_probe_warms_up_then_interleaves_rounds_in_turn_reversed():
    calls: list[tuple[str, int]] = []
    kernel_choice.choose("dense", "sig-g", ("packed", "plain"), _runner(calls))
    order = ["packed", "plain", "packed", "plain", "plain", "packed"]  # warm-up, then each round in turn reversed
    assert calls[:6] == [(path, 1) for path in order]
    for cls, rows in kernel_choice.PROBE_ROWS.items():
        n = sum(1 for path, r in calls if path == "plain" and r == rows)  # a warm-up call, then one per round
        assert kernel_choice.PROBE_MIN_ROUNDS + 1 <= n <= kernel_choice.PROBE_ROUNDS + 1, cls


def test_a_busy_machine_gets_the_default_unprobed_and_uncached(monkeypatch, capsys, tmp_path_factory):
    _load(monkeypatch, 50.0, tmp_path_factory.mktemp("proc"))
    calls: list[tuple[str, int]] = []
    choice = kernel_choice.choose("dense", "sig-h", ("packed", "plain"), _runner(calls))
    assert calls == [] and choice.paths == dict.fromkeys(kernel_choice.CLASSES, "packed")
    why = choice.reasons["decode"]
    assert why.startswith("the default, not probed, not cached: machine busy (1-minute load average 50.0, ")
    assert " runnable elsewhere now + " in why
    assert not kernel_choice.cache_path().exists()
    monkeypatch.setattr(sys, "argv", ["genkit", "info"])
    assert cli_main(["info"]) == 0
    out = capsys.readouterr().out
    assert "(no choices cached yet" in out and f"this process: dense decode   packed  [sig-h] {why}" in out
    assert "machine now: busy (1-minute load average 50.0, " in out
    _load(monkeypatch, 0.0, tmp_path_factory.mktemp("proc"))  # quiet again: the next process probes, and caches
    again = kernel_choice.choose("dense", "sig-h", ("packed", "plain"), _runner(calls))
    assert calls and again.paths == dict.fromkeys(kernel_choice.CLASSES, "plain")
    assert len(kernel_choice.cached_entries()) == len(kernel_choice.CLASSES)


def _packable_llama():
    """A 2-layer Llama whose every matrix is big enough to pack (so the dense probe runs on it)."""
    if not packing_available():
        pytest.skip("oneDNN cannot pack float32 weights on this CPU/build: no dense probe runs here")
    return tiny_llama(seed=3, hidden_size=384, intermediate_size=1024, num_attention_heads=6, num_key_value_heads=2)


def test_a_probing_first_run_samples_the_same_tokens_as_a_cached_one():
    """Bug: the probe drew its inputs from the global RNG, so the first (probing) seeded run of a
    model sampled other tokens than the later runs that read the cache."""
    runs = []
    for _ in range(2):
        model = _packable_llama()
        torch.manual_seed(11)
        out = model.generate(torch.tensor([PROMPTS["prefill"][0][:20]]), max_new_tokens=16, do_sample=True,
                             temperature=3.0, eos_token_id=None, pad_token_id=0)
        runs.append((out[0, 20:].tolist(), model._prepared[1].choice.reasons))
    (first, probed), (second, cached) = runs
    assert all(why.startswith("probe at") for why in probed.values()), probed
    assert all(why.startswith("cached probe at") for why in cached.values()), cached
    assert first == second
