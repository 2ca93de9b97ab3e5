"""The draft-model drafter: a smaller model with the target's vocabulary (Qwen3-0.6B for Qwen3-8B), run by the engine
on the target's mesh and stream threads, on a KV cache of its own whose blocks mirror the target's: a sequence's block
i in one cache is its block i in the other, so the block manager, the prefix cache, preemption and the blocks given
to drafts serve both. On a pipeline the draft model is split into the same number of stages (each stage's devices
hold its layers and their cache) and runs on a communicator and stream threads of its own (``Communicator.apart``):
its steps run while the target's micro-batches are in flight, and their sends and collectives must not meet.

Each engine step, before the target's, one draft step computes for every sequence of the plan the tokens the draft
model has no keys for yet (the prompt chunk the target computes this step, or the tokens kept in the last one) and,
for each sequence to draft, its last token's logits; then up to k - 1 decode steps extend the drafted sequences one
draft at a time, the whole batch at once. A greedy request's draft is the draft model's argmax; a sampling request's
is drawn (with the request's generator) from the draft's distribution shaped by the request's penalties, bias,
temperature and filters (a ``Kept``: its kept tokens and their probabilities, drawn by one uniform through the
inverse CDF), which the verifier gets as q. A grammar constrains the target's rows only (the rejection rule
keeps the target's distribution for any q).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dtorch.core.errors import ModelError, SamplingError
from dtorch.engine.kept import Kept, uniform
from dtorch.engine.sampling import argmax_rows, shape_logits
from dtorch.models.bucket import long_prompts
from dtorch.models.executor import Executor, StepPlan
from dtorch.models.kv_cache import KVCache


class DraftModel:
    """A loaded draft model (``executor`` over its own ``cache``); ``vocab``: the target's logits width."""

    def __init__(self, executor: Executor, cache: KVCache, vocab: int) -> None:
        self.executor, self.cache, self.vocab = executor, cache, vocab

    @classmethod
    def load(cls, source: str, target: Any, dtype: torch.dtype, communicator: Any, timeout: float) -> DraftModel:
        """The draft model at ``source`` (a path or a cached Hugging Face id) placed on ``target``'s (an ``LLM``) mesh;
        a ``ModelError`` when its vocabulary differs from the target's, it has gated delta net layers or fewer
        positions than the target's max_model_len."""
        from dtorch.models.loaders import open_checkpoint
        from dtorch.models.model import Transformer

        with open_checkpoint(source, dtype) as ckpt:
            c = ckpt.config
            where = f"speculative_config: the draft model {ckpt.source}"
            if c.linear_layers:
                raise ModelError(f"{where} has gated delta net layers: their recurrent state cannot step back past "
                                 "rejected drafts; use a draft model with attention layers only")
            if c.max_position_embeddings < target.max_len:
                raise ModelError(f"{where} has {c.max_position_embeddings} positions, fewer than max_model_len "
                                 f"{target.max_len}; lower max_model_len")
            _same_vocabulary(where, ckpt.tokenizer, c.vocab_size, target)
            model = Transformer.load(c, ckpt.get, target.mesh, target.executor.local_ids, dtype, ckpt.get_packed,
                                     max_positions=target.max_len)
        if len(model.stages) == 1:  # its steps run between the target's: on the target's streams
            executor = Executor(model, communicator, target.executor.local_ids, timeout,
                                streams=target.executor.streams)
        else:  # beside the target's micro-batches in flight: messages, collectives and stream threads of its own
            executor = Executor(model, communicator.apart(), target.executor.local_ids, timeout)
        t = target.cache
        cache = KVCache(model.layout, target.mesh, executor.local_ids, t.num_blocks, t.block_size, t.max_len, 1, dtype,
                        t.kv_dtype, model.stages)
        executor.use_cache(cache)
        return cls(executor, cache, target.config.vocab_size)

    def close(self) -> None:
        self.executor.close()

    def propose(self, engine: Any, plan: Sequence[tuple[Any, int]], ks: Sequence[int]
                ) -> tuple[list[list[int]], list[list[Kept] | None]]:
        """Catch up with ``plan`` and draft ``ks[i]`` tokens for entry i (its blocks held); returns the drafts and,
        for sampling requests, their distributions (a ``Kept`` per draft; None: greedy)."""
        tokens: list[list[int]] = [[] for _ in plan]
        probs: list[list[Kept] | None] = [None] * len(plan)
        catch = []  # (entry, first position the draft model computes)
        for i, (s, n) in enumerate(plan):
            st = s.spec
            st.draft_computed = s.computed if st.draft_computed < 0 else min(st.draft_computed, s.computed)
            if st.draft_computed < s.computed + n:
                catch.append((i, st.draft_computed))
        if not catch:
            return tokens, probs
        step = StepPlan([t for i, a in catch for t in plan[i][0].ids[a:plan[i][0].computed + plan[i][1]]],
                        [plan[i][0].computed + plan[i][1] - a for i, a in catch], [a for _, a in catch],
                        [plan[i][0].blocks for i, _ in catch], long=long_prompts(plan[i] for i, _ in catch))
        logits = self._fit(self.executor.step(step))  # [len(catch), V]: each entry's last token
        drafting = [(i, plan[i][0], ks[i]) for i, _ in catch if ks[i]]
        for i, _ in catch:
            s, n = plan[i]
            s.spec.draft_computed = s.computed + n
        if not drafting:
            return tokens, probs
        rows = [r for r, (i, _) in enumerate(catch) if ks[i]]
        logits = logits[rows]
        qs: dict[int, list[Kept]] = {i: [] for i, s, _ in drafting if not s.params.greedy}
        for j in range(max(k for _, _, k in drafting)):
            live = [(i, s) for i, s, k in drafting if k > j]
            if j:  # one more row each: the draft before, at its position
                step = StepPlan([tokens[i][-1] for i, _ in live], [1] * len(live),
                                [len(s.ids) + j - 1 for _, s in live], [s.blocks for _, s in live])
                logits = self._fit(self.executor.step(step))
            picked = self._pick(engine, logits, live, tokens, qs)
            for (i, _), t in zip(live, picked, strict=True):
                tokens[i].append(t)
        for i, q in qs.items():
            probs[i] = q
        return tokens, probs

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary: columns past it dropped, missing ones -inf."""
        v = logits.shape[-1]
        if v >= self.vocab:
            return logits[:, :self.vocab]
        return torch.nn.functional.pad(logits, (0, self.vocab - v), value=-float("inf"))

    def _pick(self, engine: Any, logits: torch.Tensor, live: list[tuple[int, Any]], tokens: list[list[int]],
              qs: dict[int, list[Kept]]) -> list[int]:
        """Each live sequence's next draft from its row of ``logits`` (rank 0 picks, the others take its picks)."""
        if engine.rank == 0:
            vocab = logits.shape[-1]
            seqs = [s for _, s in live]
            outs = [s.output_ids + tokens[i] for i, s in live]
            banned = [[t for t in s.stop_ids if t < vocab] if len(o) < s.params.min_tokens else ()
                      for s, o in zip(seqs, outs, strict=True)]
            x, _ = shape_logits(logits, [s.params for s in seqs], outs,
                                [s.ids[:s.num_prompt] if s.params.repetition_penalty != 1.0 else () for s in seqs],
                                banned)
            picked = argmax_rows(x)
            for r, (i, s) in enumerate(live):
                if s.params.greedy:
                    continue
                sp = s.params
                try:
                    q = Kept.of(x[r].float(), sp.temperature, sp.top_k, sp.top_p, sp.min_p,
                                f"drafting for request {s.request_id!r}")
                    picked[r] = q.draw(uniform(s.generator))
                except (RuntimeError, SamplingError):  # a broken distribution (NaN) of one request: a point mass on
                    # its argmax, so the others draft on; verification ends the request if its own sampling fails too
                    q = Kept.point(picked[r], x.device)
                qs[i].append(q)
        else:
            picked = [0] * len(live)
        return engine.agree(picked) if engine.agree is not None else picked


def _same_vocabulary(where: str, tokenizer: Any, vocab_size: int, target: Any) -> None:
    """A ``ModelError`` unless the draft model's tokens are the target's (the same tokenizer vocabulary where both
    have one, else the same vocab_size)."""
    mine, theirs = tokenizer, target.tokenizer
    if mine is not None and theirs is not None:
        a, b = mine.backend.get_vocab(with_added_tokens=True), theirs.backend.get_vocab(with_added_tokens=True)
        if a != b:
            diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:3]
            raise ModelError(f"{where} has another tokenizer than the target's ({len(a)} against {len(b)} tokens; "
                             f"they differ at {diff}); a draft model must share the target's vocabulary")
    elif vocab_size != target.config.vocab_size:
        raise ModelError(f"{where} has a vocabulary of {vocab_size} tokens, the target {target.config.vocab_size}; a "
                         "draft model must share the target's vocabulary")
