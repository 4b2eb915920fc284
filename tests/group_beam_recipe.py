"""Group (diverse) beam search as transformers 4.x ran it built in -- ``_group_beam_search`` with
its ``BeamSearchScorer`` and ``HammingDiversityLogitsProcessor``, which transformers 5 removed --
written as a ``custom_generate`` recipe on transformers 5's ``GenerationMixin`` internals.

The tests copy this file to ``<folder>/custom_generate/generate.py`` (``hub_server.group_beam_recipe``)
and run it through transformers' own ``generate(custom_generate=<folder>, trust_remote_code=True)``: it
is the reference for genkit's built-in diverse beam search (tests/test_diverse_beams.py,
tests/test_hf_recipes.py). docs/encoder_decoder.md records its check against transformers 4.46.3.

The algorithm of 4.x, step by step:

* one forward for all ``num_beams`` rows of every prompt; then group by group, in order: the
  ``log_softmax`` of the group's rows; the processors that 4.x's list put first (classifier-free
  guidance, ``sequence_bias``); minus ``diversity_penalty`` times how often each token was picked at
  this step by the earlier groups of the same prompt; the other processors; plus the running beam
  scores (at the start 0 for each group's first beam, -1e9 for the others);
* per prompt the best ``max(2, 1 + n_eos) * group_size`` continuations of the group, best first: one
  ending with EOS among the first ``group_size`` becomes a finished hypothesis (scored
  ``sum_logprobs / generated_length ** length_penalty``; each (prompt, group) keeps its best
  ``group_size``), and the first ``group_size`` others are the group's next beams;
* a (prompt, group) is done when it holds ``group_size`` hypotheses and ``early_stopping`` is True, or
  its worst one beats the step's best continuation (finished or not) normalised at the current
  length (at ``max_length`` for ``early_stopping="never"`` with ``length_penalty > 0``); a done group
  then "picks" the pad token on every beam, and the later groups' penalty counts it;
* the loop ends when every (prompt, group) is done or the stopping criteria hold for every row; the
  open beams of the groups not done then join their hypotheses, and each prompt returns its
  ``num_return_sequences`` best of all groups (of equal scores, the later one first), followed by
  pad tokens where shorter.

Two deliberate differences from 4.x, both in what 4.x got wrong: ``beam_indices`` are flat model rows
(the rows of ``scores``, as in beam search; 4.x recorded rows inside the group and looked them up
in an order that does not match, for batches and for groups after the first), and a hypothesis keeps
the EOS token it ended with (4.x wrote the first EOS id). Not reproduced: 4.x built the processor
of ``prefix_allowed_tokens_fn`` for one group's rows per prompt; transformers 5 builds it for all
``num_beams``, and the recipe takes transformers 5's processors as they are.
"""

from __future__ import annotations

import torch
from transformers import GenerationMixin
from transformers.generation.logits_process import (
    LogitsProcessorList,
    SequenceBiasLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput, GenerateBeamEncoderDecoderOutput

_BEFORE_PENALTY = (UnbatchedClassifierFreeGuidanceLogitsProcessor, SequenceBiasLogitsProcessor)


class Hypotheses:
    """The best ``size`` finished hypotheses of one (prompt, group)."""

    def __init__(self, size, length_penalty, early_stopping, max_length, prompt_len):
        self.size, self.length_penalty, self.early_stopping = size, length_penalty, early_stopping
        self.max_length, self.prompt_len = max_length, prompt_len
        self.items = []  # (score, tokens, rows), in the order they came
        self.worst = 1e9

    def add(self, tokens, sum_logprobs, rows):
        score = sum_logprobs / len(rows) ** self.length_penalty  # len(rows): tokens generated
        if len(self.items) < self.size or score > self.worst:
            self.items.append((score, tokens, rows))
            if len(self.items) > self.size:
                ranked = sorted((s, i) for i, (s, _, _) in enumerate(self.items))
                del self.items[ranked[0][1]]
                self.worst = ranked[1][0]
            else:
                self.worst = min(score, self.worst)

    def is_done(self, best_sum_logprobs, length):
        """``length``: the sequences' length after this step."""
        if len(self.items) < self.size:
            return False
        if self.early_stopping is True:
            return True
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            length = self.max_length
        return self.worst >= best_sum_logprobs / (length - self.prompt_len) ** self.length_penalty


class GroupSearch:
    """The state of one run: running beams (flat rows ``prompt * num_beams + group * group_size + j``),
    their scores and rows so far, and every (prompt, group)'s hypotheses."""

    def __init__(self, config, input_ids, processors):
        self.beams, groups = config.num_beams, config.num_beam_groups
        self.groups, self.size = groups, self.beams // groups
        self.batch, self.prompt_len = input_ids.shape[0] // self.beams, input_ids.shape[1]
        self.penalty = config.diversity_penalty or 0.0
        self.pad = int(config._pad_token_tensor) if config._pad_token_tensor is not None else 0
        eos = config._eos_token_tensor
        self.eos = [] if eos is None else eos.view(-1).tolist()
        self.keep = max(2, 1 + len(self.eos)) * self.size
        head = 0
        while head < len(processors) and isinstance(processors[head], _BEFORE_PENALTY):
            head += 1
        self.head, self.tail = LogitsProcessorList(processors[:head]), LogitsProcessorList(processors[head:])
        scores = torch.full((self.batch, self.beams), -1e9)
        scores[:, ::self.size] = 0.0
        self.scores = scores.view(-1).to(input_ids.device)
        self.rows = [[] for _ in range(input_ids.shape[0])]
        self.hyps = [[Hypotheses(self.size, config.length_penalty, config.early_stopping, config.max_length,
                                 self.prompt_len) for _ in range(groups)] for _ in range(self.batch)]
        self.done = [[False] * groups for _ in range(self.batch)]

    def group_rows(self, g):
        starts = torch.arange(self.batch)[:, None] * self.beams + g * self.size
        return (starts + torch.arange(self.size)[None, :]).view(-1)

    def penalised(self, scores, picked, g):
        """Group ``g``'s scores less the Hamming penalty for the tokens the earlier groups picked."""
        if g == 0 or not self.penalty > 0.0:
            return scores
        earlier = picked.view(self.batch, self.beams)[:, :g * self.size]
        counts = torch.zeros(self.batch, scores.shape[-1], dtype=scores.dtype, device=scores.device)
        counts.scatter_add_(1, earlier, torch.ones_like(earlier, dtype=scores.dtype))
        return scores - self.penalty * counts.repeat_interleave(self.size, dim=0)

    def step(self, input_ids, log_probs):
        """One step of every group: the next tokens, the rows they continue and the processed scores."""
        n = input_ids.shape[0]
        picked, parents = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)
        new_scores, new_rows = torch.zeros(n), [None] * n
        processed = torch.zeros_like(log_probs)
        for g in range(self.groups):
            rows = self.group_rows(g)
            scores = self.head(input_ids[rows], log_probs[rows])
            scores = self.tail(input_ids[rows], self.penalised(scores, picked, g))
            processed[rows] = scores
            total = (scores + self.scores[rows, None]).view(self.batch, -1)
            top, index = torch.topk(total, self.keep, dim=1, largest=True, sorted=True)
            vocab = scores.shape[-1]
            for b in range(self.batch):
                chosen = self.choose(input_ids, b, g, top[b], index[b] // vocab, index[b] % vocab)
                for slot, (token, parent, score) in enumerate(chosen):
                    row = b * self.beams + g * self.size + slot
                    picked[row], parents[row], new_scores[row] = token, parent, score
                    new_rows[row] = self.rows[parent] + [parent]
        self.scores, self.rows = new_scores.to(self.scores.device), new_rows
        return picked, parents, processed

    def choose(self, input_ids, b, g, top, local, tokens):
        """Prompt ``b``'s group ``g``: EOS continuations to the hypotheses, the next beams as
        ``(token, parent row, score)``."""
        first = b * self.beams + g * self.size
        if self.done[b][g]:
            return [(self.pad, g * self.size, 0.0)] * self.size  # 4.x: the pad token on the first prompt's row
        chosen = []
        for rank in range(self.keep):
            token, parent, score = int(tokens[rank]), first + int(local[rank]), float(top[rank])
            if token in self.eos:
                if rank < self.size:
                    ended = torch.cat([input_ids[parent], tokens[rank:rank + 1]])
                    self.hyps[b][g].add(ended, score, self.rows[parent] + [parent])
                continue
            chosen.append((token, parent, score))
            if len(chosen) == self.size:
                break
        if len(chosen) < self.size:
            raise ValueError(f"fewer than {self.size} continuations of prompt {b} do not end with EOS")
        self.done[b][g] = self.hyps[b][g].is_done(float(top[0]), input_ids.shape[1] + 1)
        return chosen

    def finish(self, input_ids, n_return):
        """The open beams of the groups not done join their hypotheses; each prompt's ``n_return``
        best as (sequences, sequences_scores, beam_indices)."""
        best = []
        for b in range(self.batch):
            for g in range(self.groups):
                for j in range(self.size if not self.done[b][g] else 0):
                    row = b * self.beams + g * self.size + j
                    self.hyps[b][g].add(input_ids[row], float(self.scores[row]), self.rows[row])
            ranked = sorted((item for g in range(self.groups) for item in self.hyps[b][g].items), key=lambda x: x[0])
            best += [ranked.pop() for _ in range(n_return)]
        width = max(len(tokens) for _, tokens, _ in best)
        steps = max(len(rows) for _, _, rows in best)
        sequences = torch.full((len(best), width), self.pad, dtype=torch.long)
        beam_indices = torch.full((len(best), steps), -1, dtype=torch.long)
        for i, (_, tokens, rows) in enumerate(best):
            sequences[i, :len(tokens)] = tokens
            beam_indices[i, :len(rows)] = torch.tensor(rows, dtype=torch.long)
        scores = torch.tensor([score for score, _, _ in best], dtype=torch.float32)
        return sequences.to(input_ids.device), scores, beam_indices


def _forward(model, input_ids, model_kwargs, config, first):
    step = {"is_first_iteration": True} if first else {"next_sequence_length": 1 if config.use_cache else None}
    inputs = model.prepare_inputs_for_generation(input_ids, **step, **model_kwargs)
    wanted = {k: True for k in ("output_attentions", "output_hidden_states") if getattr(config, k)}
    inputs.update(wanted)
    outputs = model(**inputs, return_dict=True)
    model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs,
                                                             is_encoder_decoder=model.config.is_encoder_decoder)
    return outputs, model_kwargs


def _group_beam_search(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
    config = generation_config
    if config.do_sample or config.num_beams % config.num_beam_groups:
        raise ValueError("group beam search needs do_sample=False and num_beams divisible by num_beam_groups")
    search = GroupSearch(config, input_ids, logits_processor)
    steps = {"scores": [], "logits": [], "attentions": [], "cross_attentions": [], "hidden_states": []}
    first = True
    while True:
        outputs, model_kwargs = _forward(model, input_ids, model_kwargs, config, first)
        first = False
        logits = outputs.logits[:, -1, :].to(copy=True, dtype=torch.float32)
        tokens, parents, processed = search.step(input_ids, torch.log_softmax(logits, dim=-1))
        _record(steps, outputs, logits, processed, model.config.is_encoder_decoder)
        input_ids = torch.cat([input_ids[parents], tokens[:, None].to(input_ids.device)], dim=-1)
        if model_kwargs.get("cache") is not None:
            model_kwargs["cache"].reorder_cache(parents.to(input_ids.device))
        if all(all(row) for row in search.done) or bool(stopping_criteria(input_ids, None).all()):
            break
    sequences, scores, beam_indices = search.finish(input_ids, config.num_return_sequences)
    if not config.return_dict_in_generate:
        return sequences
    return _output(model, config, model_kwargs, steps, sequences, scores, beam_indices)


def _record(steps, outputs, logits, processed, encoder_decoder):
    steps["scores"].append(processed)
    steps["logits"].append(logits)
    prefix = "decoder_" if encoder_decoder else ""
    for name in ("attentions", "hidden_states"):
        if getattr(outputs, prefix + name, None) is not None:
            steps[name].append(getattr(outputs, prefix + name))
    if getattr(outputs, "cross_attentions", None) is not None:
        steps["cross_attentions"].append(outputs.cross_attentions)


def _output(model, config, model_kwargs, steps, sequences, scores, beam_indices):
    def wanted(name, flag):
        return tuple(steps[name]) if flag else None

    fields = dict(sequences=sequences, sequences_scores=scores if config.output_scores else None,
                  scores=wanted("scores", config.output_scores), logits=wanted("logits", config.output_logits),
                  beam_indices=beam_indices if config.output_scores else None,
                  cache=model_kwargs.get("cache"))
    if not model.config.is_encoder_decoder:
        return GenerateBeamDecoderOnlyOutput(attentions=wanted("attentions", config.output_attentions),
                                             hidden_states=wanted("hidden_states", config.output_hidden_states),
                                             **fields)
    encoder = model_kwargs["encoder_outputs"]
    return GenerateBeamEncoderDecoderOutput(
        encoder_attentions=encoder.get("attentions") if config.output_attentions else None,
        encoder_hidden_states=encoder.get("hidden_states") if config.output_hidden_states else None,
        decoder_attentions=wanted("attentions", config.output_attentions),
        cross_attentions=wanted("cross_attentions", config.output_attentions),
        decoder_hidden_states=wanted("hidden_states", config.output_hidden_states), **fields)


def generate(model, *args, **kwargs):
    return GenerationMixin.generate(model, *args, custom_generate=_group_beam_search, **kwargs)
