"""The command line behaves as users of `llm`, `vllm serve` and `llama-cli` expect (issue 30, item 4;
issue 32, item 4), each habit checked through a subprocess (`python -m genkit ...`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import write_tiny_model
from hub_server import write_recipe

import genkit

MISSING = "/nonexistent/model-folder"


def genkit_cli(*args: str, stdin: str | None = None, env: dict[str, str] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "genkit", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("cli") / "tiny")


def _greedy(model_dir, prompt: str, n: int = 5) -> str:
    """What greedy decoding of ``prompt`` gives in-process (the reference the CLI must print)."""
    model, tok = genkit.load_model(model_dir), genkit.load_tokenizer(model_dir)
    enc = tok(prompt, return_tensors="pt")
    out = genkit.generate(model, **enc, max_new_tokens=n, do_sample=False)
    return tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def test_positional_prompt_option_and_stdin_give_the_same_text(model_dir):
    want = _greedy(model_dir, "the quick brown")
    common = ["--model", str(model_dir), "--max-new-tokens", "5", "--threads", "1"]
    positional = genkit_cli("generate", "the quick brown", *common)
    assert positional.returncode == 0, positional.stderr
    assert positional.stdout == want + "\n"
    assert genkit_cli("generate", "--prompt", "the quick brown", *common).stdout == want + "\n"
    assert genkit_cli("generate", "-", *common, stdin="the quick brown").stdout == want + "\n"
    assert genkit_cli("generate", *common, stdin="the quick brown").stdout == want + "\n"  # piped, no prompt
    both = genkit_cli("generate", "a", "--prompt", "b", *common)
    assert both.returncode == 2 and "give the prompt once" in both.stderr


def test_sampling_options_imply_sampling_and_n_sequences_alone_work(model_dir):
    common = ["--model", str(model_dir), "--max-new-tokens", "6", "--threads", "1", "--seed", "0"]
    out = genkit_cli("generate", "hello", "--temperature", "1.5", "--num-return-sequences", "3", *common)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line[:4] for line in lines] == ["[1] ", "[2] ", "[3] "]
    assert len(set(lines)) > 1 or len({line[4:] for line in lines}) > 1  # three samples, not one greedy copy
    again = genkit_cli("generate", "hello", "--temperature", "1.5", "--num-return-sequences", "3", *common)
    assert again.stdout == out.stdout  # seeded
    alone = genkit_cli("generate", "hello", "--num-return-sequences", "3", *common)
    assert alone.returncode == 0, alone.stderr
    assert len(alone.stdout.splitlines()) == 3
    beams = genkit_cli("generate", "hello", "--num-beams", "3", "--num-return-sequences", "2", *common)
    assert beams.returncode == 0 and len(beams.stdout.splitlines()) == 2, beams.stderr
    help_text = genkit_cli("generate", "--help").stdout
    assert help_text.count("implies sampling") >= 4


def test_temperature_0_is_greedy_and_a_chat_template_of_ones_own_is_used(model_dir, tmp_path):
    """--temperature 0 is greedy decoding (llama.cpp's, vLLM's and genkit serve's reading), not an error
    asking for a Python argument; --chat-template (a file or the text) renders the prompt instead of
    the tokenizer's template, as `genkit serve --chat-template` does."""
    common = ["--model", str(model_dir), "--max-new-tokens", "5", "--threads", "1"]
    out = genkit_cli("generate", "the quick brown", "--temperature", "0", *common)
    assert out.returncode == 0, out.stderr
    assert out.stdout == _greedy(model_dir, "the quick brown") + "\n"
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    model, tok = genkit.load_model(model_dir), genkit.load_tokenizer(model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  return_tensors="pt", chat_template=template)["input_ids"]
    want = tok.decode(genkit.generate(model, ids, max_new_tokens=5, do_sample=False)[0, ids.shape[1]:],
                      skip_special_tokens=True)
    for given in (str(tmp_path / "t.jinja"), template):
        chat = genkit_cli("generate", "hi", "--chat-template", given, *common)
        assert chat.returncode == 0 and chat.stdout == want + "\n", chat.stderr


@pytest.mark.parametrize("args, message", [
    (["--custom-generate", "nosuch"], "--custom-generate='nosuch' is not a registered strategy"),
    (["--num-beams", "2", "--stream"], "--stream cannot be combined with beam search (--num-beams 2)"),
    (["--num-return-sequences", "2", "--stream"], "--stream prints one sequence"),
    (["--num-beams", "2", "--num-return-sequences", "3"], "`num_return_sequences` (3) must be <= `num_beams` (2)"),
    (["--top-p", "1.5"], "`top_p`"),
    (["--threads", "0"], "--threads 0 is not valid; accepted: an integer from 1 to"),
    (["--threads", "100000"], "--threads 100000 is not valid"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--set", "max_new_tokenz=3"], "`max_new_tokenz` is not a generation parameter"),
    (["--system", "be brief"], "--system needs --chat"),
    (["--temperature", "0", "--top-k", "5"], "--temperature 0 is greedy decoding; --top-k samples: drop one of them"),
    (["--chat-template", "/nonexistent/t.jinja"], "--chat-template: cannot read '/nonexistent/t.jinja': No such file"),
    (["--seed", str(1 << 64)], "--seed must be an integer from -9223372036854775808 to 18446744073709551615; got "
                               "18446744073709551616"),
])
def test_options_are_checked_before_the_model_loads(args, message):
    """The model path does not exist: an error about the option, not about the model, proves the
    option was checked first; errors on config fields come without importing torch (well under the
    seconds a model load takes)."""
    start = time.perf_counter()
    out = genkit_cli("generate", "Hello", "--model", MISSING, *args)
    elapsed = time.perf_counter() - start
    assert out.returncode == 2
    assert message in out.stderr, out.stderr
    assert "not found" not in out.stderr and "None" not in out.stderr  # (CLI words, not Python's)
    if "--set" not in args:
        assert elapsed < 10  # < 1 s on an idle machine; generous for a loaded CI box
    batch = genkit_cli("batch", "in.jsonl", "out.jsonl", "--model", MISSING, "--threads", "0")
    assert batch.returncode == 2 and "--threads 0 is not valid" in batch.stderr


def test_option_errors_do_not_import_torch():
    code = ("import sys; from genkit.cli import main; rc = main(['generate', 'x', '--model', '/nonexistent', "
            "'--num-beams', '2', '--stream']); print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["2", "False"], out.stderr


def test_broken_pipe_exits_quietly(tmp_path):
    root = write_recipe(tmp_path / "recipe", {"custom_generate/generate.py": "def generate(model, **kw):\n    pass\n"})
    proc = subprocess.Popen([sys.executable, "-m", "genkit", "inspect", str(root), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before genkit writes a byte (`| head -0`)
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=120)
    assert "Broken pipe" not in err and "Traceback" not in err and "Exception ignored" not in err, err
    assert rc == 141
    shell = subprocess.run(f"{sys.executable} -m genkit inspect {root} --json | head -1", shell=True,
                           capture_output=True, text=True, timeout=120)
    assert shell.stdout == "{\n" and shell.stderr == ""


def test_one_name_for_the_demo_model():
    for command in ("generate", "serve", "batch"):
        text = genkit_cli(command, "--help").stdout
        assert "'smollm2'" in text, command
        assert "demo'" not in text and "alias" not in text, command
    out = genkit_cli("generate", "hi", "--model", MISSING)
    assert "or 'smollm2' (the demo model)" in out.stderr
    docs = open(os.path.join(os.path.dirname(__file__), "..", "docs", "models.md"), encoding="utf-8").read()
    assert "`demo`" not in docs


def test_threads_option_on_every_command_that_runs_a_model(tmp_path):
    for command in ("generate", "batch", "serve", "check", "publish", "info"):
        text = " ".join(genkit_cli(command, "--help").stdout.split())  # (help wraps its lines)
        assert "--threads N" in text and "never lowered from the load" in text, command
    root = write_recipe(tmp_path / "recipe", {"custom_generate/generate.py": "def generate(model, **kw):\n    pass\n"})
    publish = genkit_cli("publish", str(root), "org/name", "--threads", "0")  # publish's check smoke-runs the recipe
    assert publish.returncode == 2 and "--threads 0 is not valid; accepted: an integer from 1 to" in publish.stderr
    info = genkit_cli("info", "--threads", "1")
    assert info.returncode == 2
    assert info.stderr == "genkit: error: --threads applies to --probe (the thread count the kernel choices are made for)\n"
    for command in (["check", str(root)], ["publish", str(root), "org/name"]):  # nothing runs: nothing to set
        unused = genkit_cli(*command, "--no-smoke", "--threads", "1")
        assert unused.returncode == 2, unused.stderr
        assert unused.stderr == "genkit: error: --threads applies to the smoke run, which --no-smoke leaves out\n"


def test_batch_options_and_paths_are_checked_before_the_model_loads(tmp_path):
    """The model does not exist: the error about the option or the paths proves they came first."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "hi"}\n')
    for args, message in (
        (["--max-line-bytes", "0"], "--max-line-bytes must be >= 1; got 0"),
        (["--seed", "-9223372036854775809"], "--seed must be an integer from -9223372036854775808"),
        (["--workers", "4"], "--workers applies to --engine ray (the local engine runs one model in this process)"),
        (["--ray-address", "auto"], "--ray-address applies to --engine ray"),
        (["--set", "num_return_sequences=3", "--do-sample"], "`num_return_sequences` (--set) must be 1 in genkit batch (one output "
                                              "row per input row); got 3"),
        (["--num-return-sequences", "3"], "unrecognized arguments: --num-return-sequences 3"),  # not offered
    ):
        out = genkit_cli("batch", str(src), str(tmp_path / "out.jsonl"), "--model", MISSING, *args)
        assert out.returncode == 2 and message in out.stderr, out.stderr
    same = genkit_cli("batch", str(src), str(src), "--model", MISSING, "--threads", "1")
    assert same.returncode == 2
    assert same.stderr == (f"genkit: error: the output {str(src)!r} is the input file: an existing output is resumed "
                           "(its rows are taken as done), so write to another file\n")


def test_threads_set_torch_threads(model_dir, tmp_path):
    """--threads 1 runs torch with one intra-op and one inter-op thread (seen from the recipe the
    command runs, inside the process)."""
    root = write_recipe(tmp_path / "probe", {"custom_generate/generate.py": (
        "import torch\n"
        "def generate(model, input_ids, **kw):\n"
        "    print('threads', torch.get_num_threads(), torch.get_num_interop_threads())\n"
        "    return input_ids\n")})
    out = genkit_cli("generate", "hi", "--model", str(model_dir), "--custom-generate", str(root), "--threads", "1")
    assert out.returncode == 0, out.stderr
    assert "threads 1 1" in out.stdout
    torch.set_num_threads(torch.get_num_threads())  # (the parent process is untouched)
