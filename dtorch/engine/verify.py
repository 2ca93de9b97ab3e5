"""Verifying drafts: which of a sequence's draft tokens the target model keeps, and the token it adds, so that the
output is distributed exactly as plain decoding's.

Row j of a drafted sequence's logits is the target's next-token distribution after its tokens and drafts d_1..d_j.
Each row is shaped as plain sampling shapes it: penalties over the tokens before it (drafts included), the logit
bias, the grammar's mask in its state after d_1..d_j, the stop ids banned while the output is shorter than
min_tokens. Then:

- greedy: d_j+1 is kept while it is the row's argmax; the first row whose argmax differs gives that argmax and ends
  the run, so the tokens are plain greedy decoding's, id for id;
- sampling (the rejection rule of Leviathan et al. and Chen et al., 2023): with p the row's distribution after
  temperature, top-k, top-p and min-p, and q the draft's (a point mass on d_j+1 for a draft picked outright, as prompt
  lookup's), d_j+1 is kept with probability min(1, p(d) / q(d)); otherwise a token is drawn from the residual
  max(0, p - q), normalized, and the run ends. When every draft is kept, a token is drawn from the last row.
  p and q are ``Kept`` distributions: their kept tokens alone (a top-k of 40 is 40 probabilities, not V), each draw
  one float64 uniform through the inverse CDF in id order, as plain sampling draws.

A sequence gets its kept drafts and one token of the target's per step, each distributed as plain decoding draws it;
the draws come from the sequence's own generator, so a seeded request is reproducible.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from dtorch.engine.kept import Kept, uniform
from dtorch.engine.request import TokenLogprob
from dtorch.engine.sampling import argmax_rows, shape_logits, token_logprobs


def verify(logits: torch.Tensor, seqs: Sequence, drafts: Sequence[Sequence[int]],
           probs: Sequence[Sequence[Kept] | None], grammars) -> tuple[list[list[int]], list[list[TokenLogprob | None]]]:
    """Each sequence's tokens for this step: the drafts it keeps, then one of the target's.

    logits: [R, V] float32, raw; sequence i owns 1 + len(drafts[i]) rows in order (its last token's, then each
    draft's). probs[i]: the distributions the drafts were drawn from (a ``Kept`` per draft of drafts[i]; None: picked
    outright).
    grammars: the engine's ``Grammars`` (for sequences with a matcher). Returns (tokens, logprobs) per sequence, a
    ``TokenLogprob`` per token where its params ask for logprobs (else None).
    """
    widths = [1 + len(d) for d in drafts]
    starts = list(itertools.accumulate(widths, initial=0))[:-1]
    plain = all(s.params.plain and s.params.logprobs is None and len(s.output_ids) >= s.params.min_tokens
                for s in seqs)
    if plain:  # greedy on the raw logits: one argmax for every row
        best = argmax_rows(logits)
        runs = [_greedy_run(best[a:a + w], d) for a, w, d in zip(starts, widths, drafts, strict=True)]
        return runs, [[None] * len(r) for r in runs]
    x, refused = _shaped(logits, seqs, drafts, grammars)
    best = argmax_rows(x)
    runs = []
    for s, d, q, a in zip(seqs, drafts, probs, starts, strict=True):
        if s.params.greedy:
            runs.append(_greedy_run(best[a:a + len(d) + 1], d))
        else:
            runs.append(_sampled_run(x, a, s, d, q, refused, best))
    return runs, _logprobs(logits, seqs, starts, runs)


def _greedy_run(best: list[int], draft: Sequence[int]) -> list[int]:
    """The kept drafts (while each is its row's argmax ``best[j]``), then the first row's argmax that differs."""
    run = []
    for j, t in enumerate(best):
        run.append(t)
        if j == len(draft) or t != draft[j]:
            return run
    return run


def _shaped(logits: torch.Tensor, seqs: Sequence, drafts: Sequence[Sequence[int]], grammars
            ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Every row shaped as ``sample_step`` shapes it, each seeing the drafts before it; (x [R, V], refused rows)."""
    vocab = logits.shape[-1]
    params, outputs, prompts, banned, masked, masks = [], [], [], [], [], []
    for s, d in zip(seqs, drafts, strict=True):
        prompt = s.ids[:s.num_prompt] if s.params.repetition_penalty != 1.0 else ()
        stops = [t for t in s.stop_ids if t < vocab]
        for j in range(len(d) + 1):
            params.append(s.params)
            outputs.append(s.output_ids + list(d[:j]) if j else s.output_ids)
            prompts.append(prompt)
            banned.append(stops if len(s.output_ids) + j < s.params.min_tokens else ())
        if s.matcher is not None:
            masked += range(len(params) - len(d) - 1, len(params))
            masks.append(grammars.draft_masks(s.matcher, d))
    return shape_logits(logits, params, outputs, prompts, banned, (masked, torch.cat(masks)) if masks else None)


def _sampled_run(x: torch.Tensor, a: int, s, draft: Sequence[int], q: Sequence[Kept] | None,
                 refused: dict[int, torch.Tensor], best: list[int]) -> list[int]:
    """The rejection rule over rows a.. of ``x`` for a sampling sequence ``s``."""
    g, params = s.generator, s.params
    run = []
    for j in range(len(draft) + 1):
        r = a + j
        if r in refused and bool(refused[r].all()):  # a broken grammar: its matcher ends the sequence
            run.append(best[r])
            return run
        p = Kept.of(x[r].float(), params.temperature, params.top_k, params.top_p, params.min_p,
                    f"speculative verification of request {s.request_id!r}", own=False)
        if j == len(draft):
            run.append(p.draw(uniform(g)))
            return run
        t = draft[j]
        qt = 1.0 if q is None else q[j].at(t)
        if uniform(g) * qt < p.at(t):  # kept with probability min(1, p(t) / q(t))
            run.append(t)
            continue
        residual = p.minus(t if q is None else q[j])
        # p is q up to rounding (the draft would have been kept): p itself
        run.append(p.draw(uniform(g), residual if float(residual.sum()) > 0.0 else None))
        return run
    return run


def _logprobs(logits: torch.Tensor, seqs: Sequence, starts: list[int], runs: list[list[int]]
              ) -> list[list[TokenLogprob | None]]:
    """A ``TokenLogprob`` per token of each run whose sequence asks for logprobs (of its row's raw distribution)."""
    rows, params, tokens = [], [], []
    for s, a, run in zip(seqs, starts, runs, strict=True):
        if s.params.logprobs is not None:
            rows += range(a, a + len(run))
            params += [s.params] * len(run)
            tokens += run
    out: list[list[TokenLogprob | None]] = [[None] * len(run) for run in runs]
    if not rows:
        return out
    lps = iter(token_logprobs(torch.log_softmax(logits[rows].float(), dim=-1), list(range(len(rows))), params, tokens))
    for s, run, o in zip(seqs, runs, out, strict=True):
        if s.params.logprobs is not None:
            o[:] = [next(lps) for _ in run]
    return out
