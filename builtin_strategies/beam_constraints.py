"""Constrained beam search: ``force_words_ids`` (and ``constraints``) phrases and disjunctive sets.

``force_words_ids`` is a list of constraints. A constraint is either a phrase, a list of token ids
(``[5, 6, 7]``: these tokens must appear consecutively), or a disjunctive set, a list of phrases
(``[[5, 6], [9]]``: at least one of them must appear). A hypothesis is *complete* once every
constraint appears in its generated tokens; only complete hypotheses may finish on EOS.

Each step, per prompt:

1. the candidates are the usual best ``2 * num_beams`` continuations over all beams, each live
   beam's own two best continuations, and, for every live beam, the next token of every unmet constraint alternative (starting it or continuing a
   partial match that ends the beam), so a constraint can always make progress;
2. each candidate gets a *bank*: how many constraint tokens it has fulfilled (a met constraint
   counts its longest alternative's length, an unmet one its longest partial match at the end);
3. the next ``num_beams`` running beams are taken round-robin across banks, most progressed bank
   first and best score first within a bank (Hokamp & Liu 2017, Post & Vilar 2018's grid beam
   search in its bank form), so hypotheses that made progress on the constraints are not crowded
   out by unconstrained ones with better scores;
4. complete candidates that end (EOS or max length) join the finished set with the length
   penalty of beam search; incomplete ones that end are set aside and only used if a prompt
   reaches ``max_length`` with fewer complete hypotheses than ``num_return_sequences`` (then a
   warning is logged).

Complete running candidates take up to ``max(num_return_sequences, ceil(num_beams / 2))`` running
slots first (best score first), so enough complete hypotheses survive to be returned; the other
slots are filled by the bank round-robin.

Constraint state is derived from the tokens with tensor ops over all candidates; candidate
selection loops over the prompts of the batch (the bank round-robin is sequential by nature).
transformers 5.x moved this strategy to a Hub recipe; genkit ships it built in.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from genkit.config.checks import outside_vocabulary
from genkit.errors import ConfigError
from genkit.strategy import model_vocab_size
from genkit.strategy.outputs import GenerateBeamDecoderOnlyOutput

from .beam_common import (
    NEG,
    BeamRun,
    beam_call,
    check_beam_choice,
    extend,
    length_normalizer,
    sequence_buffer,
)

logger = logging.getLogger("genkit.beam")


def parse_force_words_ids(force_words_ids: Any, vocab_size: int | None = None,
                          name: str = "force_words_ids") -> list[list[list[int]]]:
    """Normalise ``force_words_ids`` (or ``constraints`` as lists, ``name``) to constraints ->
    alternatives -> token ids. A list of ints is a phrase; a list of lists of ints is a disjunctive set.
    """
    accepted = (f"`{name}` must be a non-empty list of constraints, each a phrase (non-empty list of "
                "token ids, e.g. [5, 6]) or a disjunctive set (non-empty list of phrases, e.g. [[5, 6], [9]])")
    if not isinstance(force_words_ids, (list, tuple)) or not force_words_ids:
        raise ConfigError(f"{accepted}; got {force_words_ids!r}")

    def phrase(p: Any) -> list[int]:
        if not isinstance(p, (list, tuple)) or not p or not all(isinstance(t, int) and not isinstance(t, bool)
                                                                for t in p):
            raise ConfigError(f"{accepted}; got the phrase {p!r}")
        outside = sorted({t for t in p if t < 0 or (vocab_size is not None and t >= vocab_size)})
        if outside:
            if vocab_size is None:
                raise ConfigError(f"`{name}` holds negative token ids {outside}; token ids are >= 0")
            raise ConfigError(outside_vocabulary(name, outside, vocab_size))
        return [int(t) for t in p]

    out = []
    for c in force_words_ids:
        if isinstance(c, (list, tuple)) and c and all(isinstance(x, (list, tuple)) for x in c):
            out.append([phrase(p) for p in c])
        else:
            out.append([phrase(c)])
    return out


def parse_constraints(constraints: Any, vocab_size: int | None = None) -> list[list[list[int]]]:
    """``constraints`` as :func:`parse_force_words_ids` gives them. The config holds them as lists
    (a ``PhrasalConstraint`` or ``DisjunctiveConstraint`` becomes its ``token_ids``)."""
    return parse_force_words_ids(constraints, vocab_size, name="constraints")


class ConstraintState:
    """Constraint progress of many hypotheses at once, computed from their generated tokens."""

    def __init__(self, constraints: list[list[list[int]]], device: torch.device) -> None:
        self.constraints = constraints
        self.alts = [(ci, torch.tensor(a, device=device)) for ci, c in enumerate(constraints) for a in c]
        self.weight = [max(len(a) for a in c) for c in constraints]

    def evaluate(self, gen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """For generated tokens ``gen`` ``(n, g)``: ``met`` ``(n, C)`` bool, ``bank`` ``(n,)``,
        ``next_tok`` ``(n, A)`` (next token of each alternative) and ``next_ok`` ``(n, A)``
        (that alternative belongs to an unmet constraint)."""
        n, g = gen.shape
        n_con = len(self.constraints)
        met = torch.zeros((n, n_con), dtype=torch.bool, device=gen.device)
        partial = torch.zeros((n, n_con), dtype=torch.long, device=gen.device)
        progress = []
        for ci, alt in self.alts:
            m = alt.numel()
            if g >= m:
                met[:, ci] |= (gen.unfold(1, m, 1) == alt).all(dim=-1).any(dim=-1)
            prog = torch.zeros(n, dtype=torch.long, device=gen.device)
            for k in range(min(m - 1, g), 0, -1):  # longest partial match at the end first
                hit = (gen[:, g - k:] == alt[:k]).all(dim=-1) & (prog == 0)
                prog = torch.where(hit, torch.full_like(prog, k), prog)
            partial[:, ci] = torch.maximum(partial[:, ci], prog)
            progress.append(prog)
        weight = torch.tensor(self.weight, device=gen.device)
        bank = torch.where(met, weight, partial).sum(dim=1)
        prog_all = torch.stack(progress, dim=1)  # (n, A)
        alt_con = torch.tensor([ci for ci, _ in self.alts], device=gen.device)
        next_tok = torch.stack([alt[prog_all[:, j].clamp(max=alt.numel() - 1)] for j, (_, alt) in enumerate(self.alts)],
                               dim=1)
        next_ok = ~met[:, alt_con]
        return met, bank, next_tok, next_ok


def constrained_beam_search(model: Any, input_ids: torch.Tensor, **kwargs: Any) -> GenerateBeamDecoderOnlyOutput:
    """Beam search whose returned hypotheses contain every ``force_words_ids`` constraint. ``kwargs``
    is the strategy call (``genkit.strategy.StrategyCall``)."""
    call = beam_call("constrained beam search", model, input_ids, kwargs)
    beams, constraints = _read_constraints(call, model)
    search = _ConstrainedSearch(call, beams, constraints)
    search.loop(input_ids)
    return search.output(input_ids)


def _read_constraints(call: Any, model: Any) -> tuple[int, list[list[list[int]]]]:
    """``num_beams`` and the constraints of the call (refusing settings the search cannot run)."""
    cfg = call.config
    if cfg.force_words_ids is None and not cfg.constraints:
        raise ConfigError("constrained beam search needs `force_words_ids` or `constraints` (phrases or disjunctive "
                         "sets)")
    if cfg.do_sample:
        raise ConfigError("`force_words_ids` (constrained beam search) needs do_sample=False.")
    beams = int(cfg.num_beams)
    if beams < 2:
        raise ConfigError(f"constrained beam search needs `num_beams` > 1; got {beams}")
    vocab_size = model_vocab_size(model)
    # as in transformers: `constraints` first, then the phrases and sets of `force_words_ids`
    constraints = parse_constraints(cfg.constraints, vocab_size) if cfg.constraints else []
    if cfg.force_words_ids is not None:
        constraints += parse_force_words_ids(cfg.force_words_ids, vocab_size)
    return beams, constraints


#: a finished hypothesis: (rank key, score, sequence, beam indices); the key ranks complete before incomplete
_Entry = tuple[float, float, torch.Tensor, torch.Tensor]


class _ConstrainedSearch:
    """The state of one constrained beam search: the beam run, the constraints, and per prompt the
    pool of finished hypotheses that satisfy every constraint (``pools``) and of those that do not
    (``fallback``, used only when too few complete ones exist at ``max_length``)."""

    def __init__(self, call: Any, beams: int, constraints: list[list[list[int]]]) -> None:
        self.call, self.beams = call, beams
        self.run = BeamRun(call, beams)
        self.n_return = self.run.n_return
        self.batch, self.prompt_len, self.max_length, self.device = (call.batch, call.prompt_len, call.max_length,
                                                                      call.device)
        self.lp_exp = float(call.config.length_penalty)
        self.state = ConstraintState(constraints, self.device)
        self.reserved = max(self.n_return, (beams + 1) // 2)  # running slots complete hypotheses take first
        self.n_gen = self.max_length - self.prompt_len
        self.pools: list[list[_Entry]] = [[] for _ in range(self.batch)]
        self.fallback: list[list[_Entry]] = [[] for _ in range(self.batch)]

    def loop(self, input_ids: torch.Tensor) -> None:
        """Step every prompt's beams until ``max_length`` or until no running beam can beat the pools."""
        call, run, batch, beams, prompt_len = self.call, self.run, self.batch, self.beams, self.prompt_len
        seqs = sequence_buffer(input_ids, self.max_length, run.fill, beams)
        run_scores = torch.full((batch, beams), NEG, device=self.device)
        run_scores[:, 0] = 0.0
        bidx = torch.full((batch, beams, self.n_gen), -1, dtype=torch.long, device=self.device)
        cur = prompt_len
        while True:
            flat_ids = seqs[:, :, :cur].reshape(batch * beams, cur)
            log_probs = check_beam_choice(call.logits_processor(flat_ids, run.log_probs()), batch)
            run.outputs.processed(log_probs, copy=True)
            total = log_probs.view(batch, beams, log_probs.shape[-1]) + run_scores[:, :, None]
            _, _, adv_tok, adv_ok = self.state.evaluate(flat_ids[:, prompt_len:])
            adv_tok, adv_ok = adv_tok.view(batch, beams, -1), adv_ok.view(batch, beams, -1)
            last = cur + 1 >= self.max_length
            steps = [self._step_prompt(b, total[b], adv_tok[b], adv_ok[b], run_scores[b] > NEG / 2, seqs, bidx, cur)
                     for b in range(batch)]
            new_seqs, new_scores, new_bidx, parents = zip(*steps)
            seqs, run_scores, bidx = torch.stack(new_seqs), torch.stack(new_scores), torch.stack(new_bidx)
            cur += 1
            if last or _all_done(self.pools, run_scores, beams, call.config.early_stopping, self.lp_exp, cur,
                                 prompt_len, self.max_length):
                break
            run.forward(seqs[:, :, cur - 1], torch.cat(parents))

    def _step_prompt(self, b: int, total: torch.Tensor, adv_tok: torch.Tensor, adv_ok: torch.Tensor,
                     live: torch.Tensor, seqs: torch.Tensor, bidx: torch.Tensor,
                     cur: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One prompt's step: its candidates, the finished ones into the pools, and its next running
        beams (sequences, scores, beam indices, parent rows)."""
        parent, tok, score, cand, cand_bidx = self._candidates(b, total, adv_tok, adv_ok, live, seqs, bidx, cur)
        met, bank, _, _ = self.state.evaluate(cand[:, self.prompt_len:cur + 1])
        complete = met.all(dim=1)
        hit = self.run.hits(tok, cand, cur)
        self._collect(b, hit, complete, score, cand, cand_bidx, cur)
        # running: round-robin over banks (most progressed first), best score first in a bank
        run_idx = torch.nonzero(~hit).view(-1)
        chosen = run_idx[_select_running(bank[run_idx], score[run_idx], complete[run_idx], self.beams, self.reserved)]
        return self._running(b, chosen, score, cand, cand_bidx, parent, seqs, bidx)

    def _candidates(self, b: int, total: torch.Tensor, adv_tok: torch.Tensor, adv_ok: torch.Tensor,
                    live: torch.Tensor, seqs: torch.Tensor, bidx: torch.Tensor,
                    cur: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The candidates of prompt ``b``: the overall top ``2 * beams``, each live beam's own best
        two and every token that advances a constraint; their parents, tokens, scores, sequences."""
        beams, vocab = self.beams, total.shape[-1]
        top = torch.topk(total.view(-1), min(2 * beams, beams * vocab)).indices
        rows = torch.arange(beams, device=self.device)[:, None] * vocab
        own = (rows + torch.topk(total, min(2, vocab), dim=1).indices)[live]  # each beam's own best
        forced = (rows + adv_tok)[live[:, None] & adv_ok]
        flat = torch.unique(torch.cat((top, own.view(-1), forced)))
        parent, tok = flat // vocab, flat % vocab
        score = total.view(-1)[flat]
        keep = score > NEG / 2
        parent, tok, score = parent[keep], tok[keep], score[keep]
        cand, cand_bidx = extend(seqs[b:b + 1], bidx[b:b + 1], parent[None], tok[None], parent[None] + b * beams,
                                 cur, self.prompt_len)
        return parent, tok, score, cand[0], cand_bidx[0]

    def _collect(self, b: int, hit: torch.Tensor, complete: torch.Tensor, score: torch.Tensor, cand: torch.Tensor,
                 cand_bidx: torch.Tensor, cur: int) -> None:
        """Finished candidates (``hit``) join prompt ``b``'s pool, or its fallback when incomplete."""
        normed = score / length_normalizer(cur + 1 - self.prompt_len, self.lp_exp)
        for i in torch.nonzero(hit).view(-1).tolist():
            entry = (float(normed[i]), float(normed[i]), cand[i], cand_bidx[i])
            (self.pools[b] if bool(complete[i]) else self.fallback[b]).append(entry)
        self.pools[b] = sorted(self.pools[b], key=lambda e: -e[0])[:self.beams]
        self.fallback[b] = sorted(self.fallback[b], key=lambda e: -e[0])[:self.beams]

    def _running(self, b: int, chosen: torch.Tensor, score: torch.Tensor, cand: torch.Tensor,
                 cand_bidx: torch.Tensor, parent: torch.Tensor, seqs: torch.Tensor,
                 bidx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prompt ``b``'s next beams: the ``chosen`` candidates, the other slots dead (score ``NEG``)."""
        beams, n_ch = self.beams, chosen.numel()
        s = torch.full((beams,), NEG, device=self.device)
        sq = seqs[b].clone()
        bi = bidx[b].clone()
        par = torch.full((beams,), b * beams, dtype=torch.long, device=self.device)
        if n_ch:
            s[:n_ch] = score[chosen]
            sq[:n_ch] = cand[chosen]
            bi[:n_ch] = cand_bidx[chosen]
            par[:n_ch] = parent[chosen] + b * beams
        return sq, s, bi, par

    def output(self, input_ids: torch.Tensor) -> GenerateBeamDecoderOnlyOutput:
        """The best hypotheses of each prompt, complete ones first (incomplete ones, with a
        warning, only when too few complete ones exist)."""
        beams, batch = self.beams, self.batch
        out_seqs = sequence_buffer(input_ids, self.max_length, self.run.fill, beams)
        out_scores = torch.full((batch, beams), NEG, device=self.device)
        out_bidx = torch.full((batch, beams, self.n_gen), -1, dtype=torch.long, device=self.device)
        for b in range(batch):
            chosen_entries = self.pools[b][:beams]
            if len(chosen_entries) < self.n_return:
                logger.warning("constrained beam search: prompt %d reached max_length with %d hypotheses that satisfy "
                               "every constraint; filling with incomplete ones (raise max_new_tokens)", b,
                               len(chosen_entries))
                chosen_entries = chosen_entries + self.fallback[b][:beams - len(chosen_entries)]
            for j, (_, sc, sq, bi) in enumerate(chosen_entries):
                out_seqs[b, j], out_scores[b, j], out_bidx[b, j] = sq, sc, bi
        return self.run.output(out_seqs, out_scores, out_bidx)


def _select_running(bank: torch.Tensor, score: torch.Tensor, complete: torch.Tensor, k: int,
                    reserved: int) -> torch.Tensor:
    """Complete candidates (best first) take up to ``reserved`` slots; the rest go round-robin."""
    comp = torch.nonzero(complete).view(-1)
    comp = comp[torch.argsort(score[comp], descending=True, stable=True)][:reserved]
    rest_mask = torch.ones_like(complete)
    rest_mask[comp] = False
    rest = torch.nonzero(rest_mask).view(-1)
    picked = rest[_round_robin(bank[rest], score[rest], k - comp.numel())]
    return torch.cat((comp, picked))


def _round_robin(bank: torch.Tensor, score: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of ``k`` candidates: the best of each bank (highest bank first), then the second
    best of each, and so on."""
    if bank.numel() == 0:
        return bank.new_zeros(0)
    order = torch.argsort(score, descending=True, stable=True)
    order = order[torch.argsort(bank[order], descending=True, stable=True)]  # by bank, then score
    b_sorted = bank[order]
    # rank of each candidate inside its bank
    first = torch.ones_like(b_sorted, dtype=torch.bool)
    first[1:] = b_sorted[1:] != b_sorted[:-1]
    start = torch.cummax(torch.where(first, torch.arange(len(b_sorted), device=bank.device), 0), dim=0).values
    rank = torch.arange(len(b_sorted), device=bank.device) - start
    # round-robin: rank first, then bank (descending) -- stable sort keeps bank order within a rank
    rr = torch.argsort(rank, stable=True)
    return order[rr][:k]


def _all_done(pools: list[list[Any]], run_scores: torch.Tensor, beams: int, early_stopping: Any, lp_exp: float,
              cur: int, prompt_len: int, max_length: int) -> bool:
    for b, pool in enumerate(pools):
        best = float(run_scores[b].max())
        if best <= NEG / 2:
            continue  # no live beam left for this prompt
        if len(pool) < beams:
            return False
        if early_stopping is True:
            continue
        length = (max_length if early_stopping == "never" and lp_exp > 0 else cur) - prompt_len
        if best / length_normalizer(length, lp_exp) > pool[-1][0]:
            return False
    return True
