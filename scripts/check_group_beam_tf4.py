"""Check tests/group_beam_recipe.py (transformers 4.x's group beam search written on transformers 5)
against transformers 4.x's own built-in group beam search, on the same tiny models' weights.

Two steps, in two virtual environments (the result is recorded in docs/encoder_decoder.md)::

    # 1. transformers 5 (the project's venv): weights, inputs, and the recipe's outputs
    python scripts/check_group_beam_tf4.py make /tmp/gbs
    # 2. transformers 4.x (a throwaway venv with transformers==4.46.3): its built-in group beam
    #    search on the same weights, compared with step 1's outputs
    /tmp/tf4/bin/python scripts/check_group_beam_tf4.py check /tmp/gbs

Compared per case: ``sequences`` (identical), ``sequences_scores`` (within 1e-5) and ``beam_indices``.
4.x's beam indices are rows inside the group (``prompt * group_size + j``), padded with -1 to the
whole sequence length, and for a batch they are looked up in an order that does not match, so they
are compared for batch-1 runs only, as ``row % group_size`` (the recipe records flat model rows); each
line also says whether 4.x's ``compute_transition_scores`` on its own beam indices gives back its
``sequences_scores``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

NAMES = ("t5", "bart", "pegasus", "marian", "llama")
CASES = [  # (batch, generate kwargs); "eos": True picks an EOS that ends hypotheses early
    (2, dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.5, num_return_sequences=4, max_new_tokens=8)),
    (2, dict(num_beams=6, num_beam_groups=3, diversity_penalty=0.75, num_return_sequences=3, max_new_tokens=8,
             length_penalty=2.0, eos=True)),
    (2, dict(num_beams=6, num_beam_groups=3, diversity_penalty=0.75, num_return_sequences=2, max_new_tokens=8,
             length_penalty=0.5, early_stopping="never", eos=True)),
    (1, dict(num_beams=4, num_beam_groups=2, diversity_penalty=3.0, num_return_sequences=4, max_new_tokens=10,
             early_stopping=True, eos=True)),
    (1, dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.5, num_return_sequences=4, max_new_tokens=8)),
]


def build(name):
    import seq2seq_models as S
    import transformers

    if name != "llama":
        return S.build(name)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(cfg).eval()


def inputs(name, batch):
    import seq2seq_models as S

    if name != "llama":
        return S.inputs(name, batch=batch)
    ids = torch.tensor([[0, 0, 1, 17, 42, 7], [1, 99, 3, 64, 5, 8]])[:batch]
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def make(folder: Path) -> None:
    from hub_server import group_beam_recipe
    from transformers.generation.utils import GenerationMixin

    recipe = group_beam_recipe(folder / "recipe")
    runs = []
    for name in NAMES:
        model = build(name)
        torch.save(model.state_dict(), folder / f"{name}.pt")
        for batch, case in CASES:
            kw = {k: v for k, v in case.items() if k != "eos"}
            x = inputs(name, batch)
            if case.get("eos"):  # the 3rd new token of a 2-beam run's best hypothesis
                first = GenerationMixin.generate(model, **x, num_beams=2, max_new_tokens=4, do_sample=False)
                kw["eos_token_id"] = int(first[0, -2])
            with torch.no_grad():
                out = GenerationMixin.generate(model, **x, **kw, custom_generate=recipe, trust_remote_code=True,
                                               do_sample=False, output_scores=True, return_dict_in_generate=True)
            runs.append(dict(name=name, batch=batch, kw=kw, sequences=out.sequences,
                             sequences_scores=out.sequences_scores, beam_indices=out.beam_indices))
            print(name, batch, kw, "->", tuple(out.sequences.shape))
    torch.save(runs, folder / "recipe_runs.pt")


def check(folder: Path) -> int:
    import transformers

    print("transformers", transformers.__version__, "torch", torch.__version__)
    bad = 0
    for run in torch.load(folder / "recipe_runs.pt"):
        name, kw = run["name"], run["kw"]
        model = build(name)
        missing, unexpected = model.load_state_dict(torch.load(folder / f"{name}.pt"), strict=False)
        assert not unexpected and all("embed" in k or "lm_head" in k for k in missing), (missing, unexpected)
        with torch.no_grad():
            ref = model.generate(**inputs(name, run["batch"]), **kw, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
        same_seq = torch.equal(ref.sequences, run["sequences"])
        diff = float((ref.sequences_scores - run["sequences_scores"]).abs().max()) if same_seq else float("nan")
        line = f"{name:8s} batch {run['batch']} {kw}: sequences {'==' if same_seq else '!='}, scores max diff {diff:.2e}"
        if run["batch"] == 1 and same_seq:
            size = kw["num_beams"] // kw["num_beam_groups"]
            steps = run["beam_indices"].shape[1]
            theirs = ref.beam_indices[:, :steps]
            ours = run["beam_indices"]
            same = torch.equal(torch.where(theirs >= 0, theirs % size, -1), torch.where(ours >= 0, ours % size, -1))
            line += f", beam rows % group size {'==' if same else '!='}"
        print(line + ", 4.x's own transition scores " + _self_consistent(model, ref, kw.get("length_penalty", 1.0)))
        bad += not same_seq or not diff <= 1e-5
    print("mismatches:", bad)
    return 1 if bad else 0


def _self_consistent(model, out, length_penalty):
    """Do 4.x's beam indices give back its sequences_scores through compute_transition_scores?"""
    try:
        trans = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices)
    except RuntimeError as exc:
        return f"raise ({str(exc)[:40]}...)"
    length = (out.beam_indices >= 0).sum(dim=1)
    rebuilt = trans.sum(dim=1) / length ** length_penalty
    return "add up" if torch.allclose(rebuilt, out.sequences_scores, atol=1e-4) else "do not add up"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("make", "check"))
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    if args.step == "make":
        make(args.folder)
        return 0
    return check(args.folder)


if __name__ == "__main__":
    raise SystemExit(main())
