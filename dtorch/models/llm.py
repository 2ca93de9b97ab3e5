"""``LLM``: load a model and generate, in the convention of LLM engines (vLLM's names).

    llm = dtorch.LLM()                                     # the default model
    outs = llm.generate(["prompt", ...], dtorch.SamplingParams(temperature=0.0, max_tokens=64))
    outs[0].text, outs[0].token_ids
    llm.chat([{"role": "user", "content": "..."}], params)
    llm.logits(token_ids)                                  # [T, vocab] float32, no cache

The model runs on the runtime over a ``DeviceMesh``: one device by default, ``tensor_parallel_size=n``
devices of this process (``cpu:0`` .. ``cpu:n-1``, or n GPUs), or, when ``torch.distributed`` is initialised
(``torchrun``), one device per rank, every rank running the same steps (SPMD) and agreeing on every
sampled token (rank 0 samples and broadcasts).

Generation prefills the prompts of a call in packed steps of at most ``PREFILL_TOKENS`` tokens (a longer
prompt is prefilled in chunks), then decodes all running sequences together one token per step; a
sequence that finishes leaves the batch and gives its cache slot back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dtorch.core.dtypes import as_dtype
from dtorch.core.errors import ArgumentError, ModelError
from dtorch.models.executor import Executor, StepPlan
from dtorch.models.kv_cache import KVCache
from dtorch.models.loaders import open_checkpoint
from dtorch.models.model import Transformer
from dtorch.models.parallel import MeshSetup, setup_mesh
from dtorch.models.sampling import SamplingParams, sample

PREFILL_TOKENS = 512  # tokens of one prefill step at most: prompts are packed, a longer one is chunked


@dataclass
class RequestOutput:
    """One prompt's result: the prompt, the new token ids, their text and why generation stopped.

    finish_reason: "stop" (an end-of-sequence token or stop string) or "length" (max_tokens or the context).
    """

    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationStats:
    """Timing of the last ``generate`` call: prefill and decode tokens and seconds."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class _Sequence:
    __slots__ = ("out", "params", "generator", "slot", "length", "limit", "decoder", "stop_ids", "emitted")

    def __init__(self, out: RequestOutput, params: SamplingParams, limit: int, decoder: Any,
                 stop_ids: frozenset[int]) -> None:
        self.out = out
        self.params = params
        self.generator = None if params.greedy else params.generator()
        self.slot = -1
        self.length = len(out.prompt_token_ids)  # tokens in the cache after the next step
        self.limit = limit  # new tokens at most
        self.decoder = decoder
        self.stop_ids = stop_ids
        self.emitted = 0  # characters of out.text already streamed


Prompt = str | Sequence[int]
OnText = Callable[[int, str], None]


class LLM:
    """A model loaded for generation on one device.

    model: a ``.gguf`` file or a Hugging Face directory (None: the default model). dtype: the
    activations' dtype (float32 or bfloat16 ...), and the float weights'. A GGUF's block-quantized
    projections and embedding stay as stored and run on kernels of their layout ("gguf.q4_1" ...);
    ``dequantize=True`` turns every weight into ``dtype`` at load instead. max_num_seqs: sequences
    decoded together at most (more prompts wait for a free slot).
    """

    def __init__(self, model: str | Path | None = None, *, device: str = "cpu",
                 dtype: torch.dtype | str = torch.float32, max_num_seqs: int = 16,
                 tensor_parallel_size: int = 1, dequantize: bool = False) -> None:
        if model is None:
            from dtorch.models.default import default_model_path
            model = default_model_path()
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ArgumentError(f"LLM: max_num_seqs must be an int >= 1, got {max_num_seqs!r}")
        dtype = as_dtype(dtype)
        where: MeshSetup = setup_mesh(device, tensor_parallel_size)
        with open_checkpoint(model, dtype) as ckpt:  # reads names and shapes; then only this process's slices
            self.source = ckpt.source
            self.config = ckpt.config
            self.tokenizer = ckpt.tokenizer
            self.model = Transformer.load(self.config, ckpt.get, where.mesh, where.local_ids, dtype,
                                          None if dequantize else ckpt.get_packed)
        self.mesh = where.mesh
        self.rank = where.rank
        self.device = where.mesh.device(where.local_ids[0])
        self.executor = Executor(self.model, where.communicator, where.local_ids, where.timeout)
        self._spmd = where.spmd
        self.max_num_seqs = max_num_seqs
        self.max_len = self.config.max_position_embeddings
        self.stats = GenerationStats()
        self._cache: KVCache | None = None
        eos = set(self.config.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)

    @property
    def tensor_parallel_size(self) -> int:
        return self.mesh.size

    def close(self) -> None:
        """Stop the stream threads and release the communicator (also done when the object is collected)."""
        self.executor.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"LLM({self.source!r}, {c.family}, {c.num_layers} layers, dtype={str(self.model.dtype)[6:]}, "
                f"tensor_parallel_size={self.mesh.size} on {self.mesh})")

    # -- public API -------------------------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
                 = None, *, on_text: OnText | None = None) -> list[RequestOutput]:
        """Complete each prompt (text, or a list of token ids); one ``RequestOutput`` per prompt, in order.

        ``on_text(index, piece)`` is called with new text as it is made (streaming).
        """
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        params = list(params)
        outs = self._requests(prompts, params)
        for pieces in self._steps(outs, params, on_text is not None):
            for index, piece in pieces:
                on_text(index, piece)
        return outs

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             params: SamplingParams | None = None, *, on_text: OnText | None = None) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation (a list of messages) or to several."""
        if messages and isinstance(messages[0], Mapping):
            messages = [messages]
        return self.generate([self.chat_prompt(m) for m in messages], params, on_text=on_text)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The token ids of a conversation rendered with the model's chat template, ready for the reply."""
        tok = self._need_tokenizer("chat")
        return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """The text of one prompt's completion, piece by piece as each step makes it."""
        params = [params or SamplingParams()]
        outs = self._requests([prompt], params)
        for pieces in self._steps(outs, params, True):
            for _, piece in pieces:
                yield piece

    @torch.no_grad()
    def logits(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Logits of every position of one sequence: [T, vocab] float32; a full forward pass of its own."""
        ids = self._check_ids(list(token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids), 0)
        cache = self._cache_for(1, len(ids))
        slot = cache.alloc()
        try:
            out = []
            for at in range(0, len(ids), PREFILL_TOKENS):
                chunk = ids[at:at + PREFILL_TOKENS]
                cache.reserve(slot, len(chunk))
                out.append(self.executor.step(StepPlan(chunk, [len(chunk)], [at], [slot]), all_logits=True))
            return torch.cat(out)
        finally:
            cache.release(slot)

    # -- generation -------------------------------------------------------------------------------

    def _requests(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[RequestOutput]:
        if len(params) != len(prompts):
            raise ArgumentError(f"LLM.generate: got {len(prompts)} prompts but {len(params)} SamplingParams")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ArgumentError(f"LLM.generate: params must be SamplingParams, got {type(p).__name__}")
        return [RequestOutput(p if isinstance(p, str) else None, self._encode(p, i)) for i, p in enumerate(prompts)]

    @torch.no_grad()
    def _steps(self, outs: list[RequestOutput], params: list[SamplingParams],
               streaming: bool) -> Iterator[list[tuple[int, str]]]:
        """Run generation; after each step yield the new text of each sequence (when ``streaming``)."""
        seqs = []
        for _i, (o, p) in enumerate(zip(outs, params, strict=True)):
            room = self.max_len - len(o.prompt_token_ids)
            limit = room if p.max_tokens is None else min(p.max_tokens, room)
            text = streaming or bool(p.stop)
            decoder = self._need_tokenizer("stop strings or streaming").stream_decoder() if text else None
            stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids)
            seqs.append(_Sequence(o, p, limit, decoder, stop_ids))
        cache = self._cache_for(min(len(seqs), self.max_num_seqs),
                                max(len(s.out.prompt_token_ids) + s.limit for s in seqs))
        stats = self.stats = GenerationStats()
        waiting = list(enumerate(seqs))
        running: list[tuple[int, _Sequence]] = []
        while waiting or running:
            group = self._admit(waiting, running, cache)
            if group:
                t0 = time.perf_counter()
                pieces = self._prefill(group, cache, streaming)
                stats.prefill_seconds += time.perf_counter() - t0
                stats.prefill_tokens += sum(len(s.out.prompt_token_ids) for _, s in group)
                running += [(i, s) for i, s in group if not s.out.finished]
                yield pieces
                continue
            t0 = time.perf_counter()
            pieces = self._decode(running, cache, streaming)
            stats.decode_seconds += time.perf_counter() - t0
            stats.decode_tokens += len(running)
            running = [(i, s) for i, s in running if not s.out.finished]
            yield pieces
        for s in seqs:
            if s.decoder is None and self.tokenizer is not None:
                s.out.text = self._text(s)

    def _admit(self, waiting: list, running: list, cache: KVCache) -> list[tuple[int, _Sequence]]:
        """Take waiting sequences into free cache slots (their prompts are prefilled together, in chunks)."""
        group = []
        while waiting and len(running) + len(group) < cache.num_slots:
            i, s = waiting.pop(0)
            s.slot = cache.alloc()
            group.append((i, s))
        return group

    def _prefill(self, group: list[tuple[int, _Sequence]], cache: KVCache, streaming: bool) -> list:
        """Prefill the group's prompts in steps of at most PREFILL_TOKENS tokens, then sample each first token."""
        done = [0] * len(group)  # prompt tokens of each sequence already in the cache
        last: dict[int, torch.Tensor] = {}
        while len(last) < len(group):
            ids, counts, starts, slots, members, budget = [], [], [], [], [], PREFILL_TOKENS
            for j, (_, s) in enumerate(group):
                prompt = s.out.prompt_token_ids
                take = min(len(prompt) - done[j], budget)
                if take <= 0 or budget <= 0:
                    continue
                starts.append(cache.reserve(s.slot, take))
                ids += prompt[done[j]:done[j] + take]
                counts.append(take)
                slots.append(s.slot)
                members.append(j)
                done[j] += take
                budget -= take
            logits = self.executor.step(StepPlan(ids, counts, starts, slots))
            for row, j in enumerate(members):
                if done[j] == len(group[j][1].out.prompt_token_ids):
                    last[j] = logits[row]
        return self._accept(group, torch.stack([last[j] for j in range(len(group))]), cache, streaming)

    def _decode(self, running: list[tuple[int, _Sequence]], cache: KVCache, streaming: bool) -> list:
        seqs = [s for _, s in running]
        starts = [cache.reserve(s.slot, 1) for s in seqs]
        plan = StepPlan([s.out.token_ids[-1] for s in seqs], [1] * len(seqs), starts, [s.slot for s in seqs])
        return self._accept(running, self.executor.step(plan), cache, streaming)

    def _accept(self, group: list[tuple[int, _Sequence]], logits: torch.Tensor, cache: KVCache,
                streaming: bool) -> list[tuple[int, str]]:
        """Sample one token per sequence; finish sequences that stop; returns the new text of each (streaming)."""
        pieces = []
        seqs = [s for _, s in group]
        tokens = self._agree(sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
                             if self.rank == 0 else [0] * len(seqs))
        for (index, s), tok in zip(group, tokens, strict=True):
            out = s.out
            out.token_ids.append(tok)
            reason = None
            if tok in s.stop_ids:
                reason = "stop"
            elif s.decoder is not None:
                out.text += s.decoder.push(tok)
                reason = self._check_stop(s)
            if reason is None and len(out.token_ids) >= s.limit:
                reason = "length"
            if streaming:
                hold = 0 if reason else max((len(x) - 1 for x in s.params.stop), default=0)
                end = max(s.emitted, len(out.text) - hold)
                if end > s.emitted:
                    pieces.append((index, out.text[s.emitted:end]))
                    s.emitted = end
            if reason is not None:
                out.finish_reason = reason
                cache.release(s.slot)
        return pieces

    @staticmethod
    def _check_stop(s: _Sequence) -> str | None:
        text = s.out.text
        for stop in s.params.stop:
            at = text.find(stop, max(0, s.emitted - len(stop)))
            if at >= 0:
                s.out.text = text[:at]
                return "stop"
        return None

    # -- helpers ----------------------------------------------------------------------------------

    def _text(self, s: _Sequence) -> str:
        ids = s.out.token_ids
        if s.out.finish_reason == "stop" and ids and ids[-1] in s.stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids)

    def _agree(self, tokens: list[int]) -> list[int]:
        """Every rank takes rank 0's sampled tokens (SPMD); in one process they are already everyone's."""
        if not self._spmd:
            return tokens
        t = torch.tensor(tokens, dtype=torch.int64, device=self.device.torch)
        self.executor.comm.broadcast(self.executor.local_ids[0], t, t, src=0)  # a lost peer: CommunicationError
        return t.tolist()

    def _cache_for(self, num_seqs: int, max_len: int) -> KVCache:
        """A cache that holds ``num_seqs`` sequences of ``max_len`` tokens: the current one if it fits, else a
        bigger one (slots: max_num_seqs at least; rows: a power of two, at least 256), which rebuilds the graphs."""
        if self._cache is None or not self._cache.fits(num_seqs, max_len, self.model.dtype):
            old = self._cache
            slots = max(num_seqs, self.max_num_seqs, old.num_slots if old else 0)
            rows = max(256, old.max_len if old else 0)
            while rows < max_len:
                rows *= 2
            self._cache = None  # free the old one first
            self.executor.use_cache(None)
            self._cache = KVCache(self.model.layout, self.mesh, self.executor.local_ids, slots,
                                  min(rows, max(self.max_len, max_len)), self.model.dtype)
            self.executor.use_cache(self._cache)
        self._cache.reset()
        return self._cache

    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise ModelError(f"{self.source}: the model has no tokenizer, so {what} is not available; "
                             "pass prompts as lists of token ids")
        return self.tokenizer

    def _encode(self, prompt: Prompt, index: int) -> list[int]:
        if isinstance(prompt, str):
            ids = self._need_tokenizer("text prompts").encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise ArgumentError(f"LLM.generate: prompt {index} must be a str or a list of token ids, "
                                f"got {type(prompt).__name__}")
        return self._check_ids(ids, index)

    def _check_ids(self, ids: list[int], index: int) -> list[int]:
        if not ids:
            raise ArgumentError(f"LLM: prompt {index} is empty; give at least one token")
        vocab = self.config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ArgumentError(f"LLM: prompt {index} has token id {t!r}; ids must be ints in [0, {vocab})")
        if len(ids) >= self.max_len:
            raise ModelError(f"LLM: prompt {index} has {len(ids)} tokens, but the model's context is {self.max_len} "
                             "tokens (max_position_embeddings) and at least one new token must fit")
        return ids

