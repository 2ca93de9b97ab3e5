"""``TokenTaking``: how the tokens a step samples become each request's news (``Engine``'s half that takes tokens).

A step's logits rows are sampled (``sample_step``, under each sequence's grammar mask), or verified against its drafts
(speculation); each token is appended to its sequence, checked against the stop conditions (stop ids, stop strings,
the grammar, the length limit) and sent to the request's sink as a ``Delta``. A failure in any of this for one row
(its sampling, its text, its grammar, its sink) ends that request alone ("abort"), never the others of the step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from dtorch.engine.request import Delta
from dtorch.engine.sampling import sample_step
from dtorch.engine.scheduler import Sequence
from dtorch.engine.speculative import Drafts
from dtorch.engine.structured import error_line

if TYPE_CHECKING:
    import torch

log = logging.getLogger("dtorch.engine")


class TokenTaking:
    """A mixin of ``Engine``: it uses the engine's ``rank``, ``agree``, ``grammars``, ``speculator``, ``_counts``,
    ``abort``, ``_end`` and ``_finish``."""

    def _accept(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample one token for each of ``seqs`` (rows of ``logits``), then stop or go on. A row whose sampling fails
        ends alone ("abort"); the others take their tokens."""
        if self.rank == 0:
            tokens, logprobs = self._sample(seqs, logits)
        else:
            tokens, logprobs = [0] * len(seqs), [None] * len(seqs)
        if self.agree is not None:
            tokens = self.agree(tokens)  # rank 0's -1 (a failed row) reaches every rank: they all end it
        failed = [s for s, tok in zip(seqs, tokens, strict=True) if tok < 0]
        if failed:
            self._end(failed, "abort")
        done = []
        for s, tok, lp in zip(seqs, tokens, logprobs, strict=True):
            if tok >= 0 and self._take_alone(s, tok, lp):
                done.append(s)
        if done:
            self._finish(done)

    def _take_alone(self, s: Sequence, tok: int, lp) -> bool:
        """``_take``; a failure there (its text, its grammar) ends ``s`` alone ("abort"), not the step's others."""
        try:
            return self._take(s, tok, lp)
        except Exception:
            log.exception("taking a token for request %r failed; it is aborted", s.request_id)
            self._end([s], "abort")
            return False

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[int], list]:
        """``sample_step`` over ``seqs``; if the batch fails, each row alone, a row that still fails getting
        token -1 (its request's own failure must not end the requests batched with it)."""
        try:
            return self._sample_rows(seqs, logits)
        except Exception:
            if len(seqs) == 1:
                log.exception("sampling request %r failed; it is aborted", seqs[0].request_id)
                return [-1], [None]
        tokens, logprobs = [], []
        for r, s in enumerate(seqs):
            try:
                (tok,), (lp,) = self._sample_rows([s], logits[r:r + 1])
            except Exception:
                log.exception("sampling request %r failed; it is aborted", s.request_id)
                tok, lp = -1, None
            tokens.append(tok)
            logprobs.append(lp)
        return tokens, logprobs

    def _sample_rows(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[int], list]:
        vocab = logits.shape[-1]
        banned = [[t for t in s.stop_ids if t < vocab] if len(s.output_ids) < s.params.min_tokens else ()
                  for s in seqs]  # no end before min_tokens
        constrained = [r for r, s in enumerate(seqs) if s.matcher is not None]  # the others pay nothing
        allowed = (constrained, self.grammars.masks([seqs[r].matcher for r in constrained])) \
            if constrained else None
        return sample_step(logits, [s.params for s in seqs], [s.generator for s in seqs],
                           [s.output_ids for s in seqs],
                           [s.ids[:s.num_prompt] if s.params.repetition_penalty != 1.0 else ()
                            for s in seqs],  # only the repetition penalty reads the prompt
                           banned, allowed)

    def _verify(self, seqs: list[Sequence], logits: torch.Tensor, drafts: Drafts, entries: list[int]) -> None:
        """Take each of ``seqs``'s verified tokens (the drafts it keeps, then the target's own; ``logits``: its rows,
        ``entries``: its entry in the step's ``drafts``) one by one until it ends; then settle what it drafted."""
        runs, logprobs = self.speculator.verify(self, seqs, logits, drafts, entries)
        failed = [s for s, run in zip(seqs, runs, strict=True) if not run]  # its verification failed: it ends alone
        if failed:
            self._end(failed, "abort")
        done = []
        for s, run, lps, i in zip(seqs, runs, logprobs, entries, strict=True):
            if not run:
                continue
            taken = 0
            for tok, lp in zip(run, lps, strict=True):
                taken += 1
                if self._take_alone(s, tok, lp):
                    done.append(s)
                    break
                if s.finished:  # its take failed: it ended alone
                    break
            if drafts.tokens[i]:
                self.speculator.settle(self, s, drafts.tokens[i], run, taken, drafts.rollback)
        if done:
            self._finish(done)

    def _take(self, s: Sequence, tok: int, lp) -> bool:
        """Append ``tok`` (with its logprob ``lp``) to ``s``, decide whether ``s`` ends there and send its delta;
        returns whether it ended."""
        s.ids.append(tok)
        s.output_ids.append(tok)
        self._counts["generation"] += 1
        reason = None
        stoppable = len(s.output_ids) >= s.params.min_tokens
        if tok in s.stop_ids and stoppable:
            reason = "stop"
            s.stop_reason = tok if tok in s.params.stop_token_ids else None
        elif s.decoder is not None:
            s.text += s.decoder.push(tok)
            reason = self._stop_string(s) if stoppable else None
        if s.matcher is not None:  # every rank keeps the grammar's state: they all decide when it ends
            accepted = s.matcher.consume_token(tok)
            if reason is None and (not accepted or s.matcher.is_stopped()):  # complete: nothing more may follow
                reason = "stop"
                if not accepted:
                    log.error("request %r: the grammar refused token %d (%s)", s.request_id, tok,
                              error_line(s.matcher.get_error()))
        if reason is None and len(s.output_ids) >= s.limit:
            reason = "length"
        hold = 0 if reason else max((len(x) - 1 for x in s.params.stop), default=0)
        end = max(s.emitted, len(s.text) - hold)
        piece = s.text[s.emitted:end]
        s.emitted = end
        if reason is not None:
            s.finish_reason = reason
        self._emit(s, (tok,), piece, None if s.params.logprobs is None else (lp,))
        return reason is not None

    @staticmethod
    def _stop_string(s: Sequence) -> str | None:
        for stop in s.params.stop:
            at = s.text.find(stop, max(0, s.emitted - len(stop)))
            if at >= 0:
                s.text = s.text[:at + len(stop) if s.params.include_stop_str_in_output else at]
                s.stop_reason = stop
                return "stop"
        return None

    def _emit(self, s: Sequence, tokens: tuple[int, ...], text: str, logprobs) -> None:
        try:
            s.sink(Delta(s.request_id, s.index, tokens, text, logprobs, s.finish_reason, s.num_prompt,
                         len(s.output_ids), s.cached_tokens, s.stop_reason))
        except Exception:  # a failing sink ends its own request, not the step of everyone else
            log.exception("the sink of request %r failed; the request is aborted", s.request_id)
            if not s.finished:
                self.abort(s.request_id)
