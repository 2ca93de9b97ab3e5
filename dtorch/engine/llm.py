"""``LLM``: load a model and generate, in the convention of LLM engines (vLLM's names).

    llm = dtorch.LLM()                                     # the default model
    outs = llm.generate(["prompt", ...], dtorch.SamplingParams(temperature=0.0, max_tokens=64))
    outs[0].text, outs[0].token_ids
    llm.chat([{"role": "user", "content": "..."}], params)
    llm.logits(token_ids)                                  # [T, vocab] float32, no cache

The model runs on the runtime over a ``DeviceMesh``: one device by default, ``tensor_parallel_size=n``
devices of this process (``cpu:0`` .. ``cpu:n-1``, or n GPUs), or, when ``torch.distributed`` is initialised
(``torchrun``), one device per rank, every rank running the same steps (SPMD) and agreeing on every
sampled token (rank 0 samples and broadcasts). ``pipeline_parallel_size=p`` splits the layers into p contiguous
stages (``pp_layers``: each stage's count), each on its own ``tensor_parallel_size`` devices (or ranks): a (pp, tp)
mesh, stages passing the residual stream by send/recv (``dtorch.models.parallel.pipeline_stages``), with up to p
micro-batches of the running sequences in flight (``dtorch.models.pipeline``).

Generation runs on the ``Engine`` (continuous batching on a paged KV cache with prefix caching): ``generate``
queues its prompts and steps the engine until they finish. Callers in several threads may generate at once: their
requests share the batch, each gets only its own tokens, and whichever caller is waiting runs the steps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dtorch.core import env
from dtorch.core.dtypes import as_dtype
from dtorch.core.errors import ArgumentError, DtorchError, ModelError
from dtorch.core.memory import huge_pages, map_large_allocations, trim_heap
from dtorch.engine.chat_format import ChatSetup, prepare_chat, split_reply, with_tool_grammar
from dtorch.engine.engine import Engine
from dtorch.engine.outputs import new_requests, request_base, run_requests
from dtorch.engine.prompt_pass import check_pooling
from dtorch.engine.request import GenerationStats, RequestOutput
from dtorch.engine.sampling import SamplingParams
from dtorch.engine.speculative import SpeculativeConfig, speculator_for
from dtorch.models.executor import Executor, StepPlan
from dtorch.models.kv_cache import KVCache, cache_dtype, kv_blocks
from dtorch.models.loaders import open_checkpoint
from dtorch.models.loaders.checkpoint import LazyCheckpoint
from dtorch.models.model import Transformer
from dtorch.models.pack_cache import PackCache
from dtorch.models.parallel import MeshSetup, head_cost, pipeline_stages, setup_mesh
from dtorch.models.tokenizer import check_text, no_tokenizer_message

PREFILL_TOKENS = 512  # default max_num_batched_tokens: tokens of one step at most (a longer prompt is chunked)
BLOCK_SIZE = 16  # tokens per KV cache block
_said: set[str] = set()  # load warnings given in this process (info and bench load a model more than once)


def _say_once(message: str) -> None:
    """Log ``message`` as a warning on the ``dtorch.models`` logger, once per process."""
    if message not in _said:
        _said.add(message)
        logging.getLogger("dtorch.models").warning(message)


Prompt = str | Sequence[int]
OnText = Any  # Callable[[int, str], None]


@contextlib.contextmanager
def _opened(model: str | Path | LazyCheckpoint, dtype: torch.dtype, check_finite: bool) -> Iterator[LazyCheckpoint]:
    """``model`` opened (``open_checkpoint``), or as it is when the caller opened it already (its metadata is then
    not parsed again; it is closed here all the same)."""
    if not isinstance(model, LazyCheckpoint):
        model = open_checkpoint(model, dtype, check_finite=check_finite)
    elif model.dtype != dtype or model.check_finite != check_finite:
        raise ArgumentError(f"LLM: the checkpoint {model.source} was opened with dtype {model.dtype} and "
                            f"check_finite={model.check_finite}; expected {dtype} and {check_finite}")
    with model:
        yield model


class LLM:
    """A model loaded for generation on one device or a mesh, with its engine.

    model: a ``.gguf`` file, a Hugging Face directory, a directory holding one ``.gguf``, or a Hugging Face id found
    in the local Hugging Face cache (nothing is downloaded; None: the default model); or a ``LazyCheckpoint`` the
    caller opened (``open_checkpoint``, same dtype and check_weights) so its metadata is not parsed again (it is
    closed after the load). A GGUF's packed weights come from, or go to, the pack cache (``dtorch.models.pack_cache``;
    ``pack_cache.status`` says which); ``load_seconds`` is how long this took. dtype: the activations' dtype
    (float32 or bfloat16 ...), and the float weights'. A GGUF's block-quantized projections and embedding stay as
    stored and run on kernels of their layout ("gguf.q4_1" ...), each part of a fused projection in its own format;
    float16 / bfloat16 ones (GGUF or safetensors) stay 16-bit ("f16", "bf16") beside wider activations; a format no
    kernel keeps is dequantized, and a warning at load says which tensors and what it costs. ``dequantize=True``
    turns every weight into ``dtype`` at load instead.

    Engine settings (vLLM's names): max_num_seqs: sequences in a step at most. max_num_batched_tokens: tokens in a
    step at most (prompts longer than that are prefilled in chunks). max_model_len: tokens of a sequence at most
    (default: the model's max_position_embeddings). kv_cache_memory_bytes: the paged KV cache's size (default: what
    max_num_seqs sequences of max_model_len need, at most 1 GiB but at least one such sequence, and at most half the
    available memory). block_size: tokens per
    cache block. kv_cache_dtype: the keys' and values' dtype in the cache, "auto" (the activations'), "bfloat16",
    "float16" or "float32": bfloat16 under float32 activations halves the cache's memory and what attention reads
    each step (llama.cpp keeps float16 keys), each key rounded once as it is stored. enable_prefix_caching: share the
    cached blocks of common prompt prefixes. max_waiting: queued
    requests at most before the engine refuses more (``EngineBusy``; ``generate`` itself always queues).
    threads: intra-op CPU threads, set for the process with ``torch.set_num_threads`` (None: ``DTORCH_THREADS``,
    else torch's default, one per physical core); on cores busy with other work, give only the free ones.
    check_weights: refuse non-finite weights at load, naming the tensor (a cheap pass over each; False skips it).
    enforce_eager: never capture. Otherwise, on a single GPU, each decode step shape is recorded as a CUDA graph on its
    second run and replayed after (capture-safe kernels only); ``capture_report()`` says which shapes replay and why
    the others do not. On a CPU, or a mesh of several devices, steps run uncaptured either way.
    speculative_config: speculative decoding, as vLLM's dict (``speculative.SpeculativeConfig``): ``{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}`` or ``{"method": "draft_model",
    "model": PATH, "num_speculative_tokens": 4}``; outputs are distributed as without it (greedy: the same ids).
    A GGUF file whose vocabulary dtorch cannot build loads without a tokenizer (``tokenizer`` None, ``tokenizer_error``
    says why, once as a warning): prompts are token ids, and what needs text raises naming the reason.
    batch_invariant: a sequence's tokens never depend on the others decoded beside it (None: DTORCH_BATCH_INVARIANT).
    Off, a batch of 4 or more decodes lets the quantized kernels round activations to 8 bits (as llama.cpp does):
    1.5-2x faster products, with greedy tokens that may differ from the same request run alone.
    """

    def __init__(self, model: str | Path | None = None, *, device: str = "cpu",
                 dtype: torch.dtype | str = torch.float32, max_num_seqs: int = 16, tensor_parallel_size: int = 1,
                 dequantize: bool = False, max_num_batched_tokens: int = PREFILL_TOKENS,
                 max_model_len: int | None = None, kv_cache_memory_bytes: int | None = None,
                 block_size: int = BLOCK_SIZE, kv_cache_dtype: torch.dtype | str = "auto",
                 enable_prefix_caching: bool = True, max_waiting: int = 1024, threads: int | None = None,
                 check_weights: bool = True, enforce_eager: bool = False,
                 speculative_config: Mapping[str, Any] | SpeculativeConfig | None = None,
                 batch_invariant: bool | None = None, pipeline_parallel_size: int = 1,
                 pp_layers: Sequence[int] | None = None) -> None:
        if model is None:
            from dtorch.models.default import default_model_path
            model = default_model_path()
        if not isinstance(model, (str, os.PathLike, LazyCheckpoint)):
            raise ArgumentError(f"LLM: model must be a path (str or Path), a Hugging Face id or an opened "
                                f"checkpoint (open_checkpoint), got {model!r:.100}")
        if not isinstance(device, str):
            raise ArgumentError(f"LLM: device must be a str ('cpu' or 'cuda'), got {device!r:.100}")
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("block_size", block_size), ("max_waiting", max_waiting),
                            ("max_model_len", 1 if max_model_len is None else max_model_len),
                            ("kv_cache_memory_bytes", 1 if kv_cache_memory_bytes is None else kv_cache_memory_bytes),
                            ("threads", 1 if threads is None else threads)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ArgumentError(f"LLM: {name} must be an int >= 1, got {value!r}")
        batch_invariant = env.batch_invariant() if batch_invariant is None else batch_invariant
        for name, flag in (("enable_prefix_caching", enable_prefix_caching), ("check_weights", check_weights),
                           ("enforce_eager", enforce_eager), ("batch_invariant", batch_invariant)):
            if not isinstance(flag, bool):
                raise ArgumentError(f"LLM: {name} must be a bool, got {flag!r}")
        spec = None if speculative_config is None else SpeculativeConfig.from_dict(speculative_config)
        threads = threads or env.threads()
        if threads:
            torch.set_num_threads(threads)  # before the load: the streams take their share of these
        dtype = as_dtype(dtype)
        kv_dtype = cache_dtype(kv_cache_dtype, dtype)
        where: MeshSetup = setup_mesh(device, tensor_parallel_size, pipeline_parallel_size)
        if pp_layers is not None and (isinstance(pp_layers, (str, bytes)) or not isinstance(pp_layers, Sequence)):
            raise ArgumentError(f"LLM: pp_layers must be a sequence of ints (layers per stage), got {pp_layers!r:.60}")
        map_large_allocations()  # the load's freed buffers then leave RSS instead of staying in the heap
        started = time.perf_counter()
        # reads names and shapes; then only this process's slices
        with _opened(model, dtype, check_weights) as ckpt:
            self.source = ckpt.source
            self.config = ckpt.config
            self.tokenizer = ckpt.tokenizer
            self.tokenizer_error = ckpt.tokenizer_error  # why the file's vocabulary was not built, or None
            if self.tokenizer_error is not None:
                _say_once(f"{self.source}: no tokenizer: {self.tokenizer_error}; the model runs on token ids only "
                          "(generate from ids, info, bench), and text prompts and chat are refused")
            positions = self.config.max_position_embeddings
            if max_model_len is not None and max_model_len > positions:
                raise ArgumentError(f"LLM: max_model_len {max_model_len} is more than the model's {positions} "
                                    "positions (max_position_embeddings)")
            self.max_len = max_model_len or positions
            # the packed weights' cache entry of a GGUF file (None: off, or nothing kept packed)
            # (the stages' layers too: which weights a device holds)
            split = "" if pipeline_parallel_size == 1 else " stages " + ",".join(
                str(len(st.layers)) for st in pipeline_stages(where.mesh, self.config.num_layers, pp_layers,
                                                              head_cost(self.config)))
            self.pack_cache = None if dequantize else PackCache.open(
                ckpt.source, dtype, f"{where.mesh!r} local {list(where.local_ids)}{split}", check_weights)
            self.model = Transformer.load(self.config, ckpt.get, where.mesh, where.local_ids, dtype,
                                          None if dequantize else ckpt.get_packed, max_positions=self.max_len,
                                          batch_invariant=batch_invariant, cache=self.pack_cache,
                                          pp_layers=None if pp_layers is None else tuple(pp_layers))
            if not dequantize:  # asked for: nothing to say
                ckpt.report_widened()
        trim_heap()  # the load's buffers (file reads, packing, metadata) are freed: give their pages back
        # bytes of the weights in 2 MiB pages (moved there where they were not): a decode step reads every weight,
        # with fewer TLB misses so
        self.weights_in_huge_pages = 0 if env.no_huge_pages() else huge_pages(
            b.tensor for w in self.model.weights.values() for b in w.blobs.values())
        self.mesh = where.mesh
        self.rank = where.rank
        self.device = where.mesh.device(where.local_ids[0])
        self.executor = Executor(self.model, where.communicator, where.local_ids, where.timeout,
                                 capture=not enforce_eager)  # Capture.for_steps: one GPU only
        self._spmd = where.spmd
        self.max_num_seqs = max_num_seqs
        self.stats = GenerationStats()
        eos = set(self.config.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        blocks = kv_blocks(self.config, kv_dtype, max_num_seqs, self.max_len, kv_cache_memory_bytes, block_size)
        self.cache = KVCache(self.model.layout, self.mesh, self.executor.local_ids, blocks, block_size, self.max_len,
                             max_num_seqs, dtype, kv_dtype, self.model.stages)
        self.executor.use_cache(self.cache)
        self.engine = Engine(self.executor, self.cache, tokenizer=self.tokenizer, eos_token_ids=self.eos_token_ids,
                             vocab_size=self.config.vocab_size, max_len=self.max_len, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             enable_prefix_caching=enable_prefix_caching, max_waiting=max_waiting, rank=self.rank,
                             agree=self._agree if self._spmd else None, device=self.device.torch,
                             speculator=speculator_for(spec, self, dtype, where))
        self.load_seconds = time.perf_counter() - started  # LLM(...) from the file's opening to a ready engine

    @property
    def tensor_parallel_size(self) -> int:
        return self.mesh.tp_size

    @property
    def pipeline_parallel_size(self) -> int:
        return self.mesh.pp_size

    def capture_report(self) -> dict[str, str]:
        """Each step shape built so far ("decode 4 seqs", "prefill 64 tokens / 2 seqs") -> "captured", "to capture"
        (its next run records) or why it runs uncaptured."""
        self._open("capture_report")
        def name(b) -> str:
            return f"decode {b.seqs} seqs" if b.decode else f"{b.tokens} tokens / {b.seqs} seqs"
        return {name(b): status for b, status in self.executor.capture_report().items()}

    def close(self) -> None:
        """Stop the stream threads and release the communicator (also done when the object is collected). Every
        method but ``close`` then raises a ``DtorchError`` saying the LLM is closed."""
        self._closed = True
        self.engine.accepting = False
        if self.engine.speculator is not None:
            self.engine.speculator.close()
        self.executor.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"LLM({self.source!r}, {c.family}, {c.num_layers} layers, dtype={str(self.model.dtype)[6:]}, "
                f"tensor_parallel_size={self.mesh.tp_size}"
                + (f", pipeline_parallel_size={self.mesh.pp_size}" if self.mesh.pp_size > 1 else "")
                + f" on {self.mesh})")

    # -- public API -------------------------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
                 = None, *, on_text: OnText | None = None) -> list[RequestOutput]:
        """Complete each prompt (text, or a list of token ids); one ``RequestOutput`` per prompt, in order, with its
        ``params.n`` choices in ``outputs``.

        ``on_text(index, piece)`` is called with new text as it is made (streaming), in the caller's thread; index
        counts the choices of all prompts in order (the prompt's index when every n is 1).

        A text prompt is raw: special tokens written in it (``<|im_start|>``) are control tokens; for a conversation
        whose user text must stay text, use ``chat`` or ``chat_prompt``. No prompts (``[]``): ``[]``, as vLLM.
        """
        self._open("generate")
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if isinstance(prompts, Mapping) or not isinstance(prompts, Iterable):
            raise ArgumentError("LLM.generate: prompts must be a str, a list of token ids, or a list of those, got "
                                f"{type(prompts).__name__}")
        if on_text is not None and not callable(on_text):
            raise ArgumentError(f"LLM.generate: on_text must be callable (index, piece), got {on_text!r:.100}")
        prompts = list(prompts)
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        params = list(params)
        outs = self._requests(prompts, params)
        for pieces in self._run(outs, params):
            if on_text is not None:
                for index, piece in pieces:
                    on_text(index, piece)
        return outs

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             params: SamplingParams | None = None, *, tools: Sequence[Mapping[str, Any]] | None = None,
             tool_choice: str | Mapping[str, Any] | None = None, parallel_tool_calls: bool = True,
             chat_template_kwargs: Mapping[str, Any] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, on_text: OnText | None = None,
             allow_special_tokens: bool = False) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation (a list of messages) or to several.

        tools: OpenAI's ``[{"type": "function", "function": {"name", "description", "parameters"}}]``, passed to
        the chat template (or rendered by dtorch's default where the template has no tool support); tool_choice:
        "none", "auto" (the default with tools), "required" or ``{"type": "function", "function": {"name": ...}}``
        (the last two constrain the reply to valid calls). chat_template_kwargs: more template variables
        (``{"enable_thinking": False}``). Each choice's reply is split: ``text`` (the content),
        ``reasoning_content`` and ``tool_calls``; ``on_text`` gets the raw text as it comes.
        ``allow_special_tokens``: as in ``chat_prompt``.
        """
        self._open("chat")
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise ArgumentError("LLM.chat: messages must be a non-empty list of {'role': str, 'content': str} dicts "
                                f"(or a list of such conversations), got {messages!r:.200}")
        if isinstance(messages[0], Mapping):
            messages = [messages]
        params = params or SamplingParams()
        setups = [self.chat_setup(m, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                                  chat_template_kwargs=chat_template_kwargs,
                                  add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message,
                                  allow_special_tokens=allow_special_tokens) for m in messages]
        outs = self.generate([s.prompt_ids for s in setups], [with_tool_grammar(params, s) for s in setups],
                             on_text=on_text)
        for out, setup in zip(outs, setups, strict=True):
            for c in out.outputs:
                split_reply(c, setup)
        return outs

    def chat_setup(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> ChatSetup:
        """A conversation's prompt and how to read its reply (``chat_format.prepare_chat``; options as ``chat``); a
        conversation whose rendered text cannot fit the context is refused before it is encoded (``limit=None``:
        encoded whatever its length)."""
        self._open("chat_setup")
        options.setdefault("limit", self.max_len - 1)
        return prepare_chat(self.need_tokenizer("chat"), messages, **options)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], *, allow_special_tokens: bool = False,
                    **options: Any) -> list[int]:
        """The token ids of a conversation rendered with the model's chat template, ready for the reply
        (``options``: tools, chat_template_kwargs ... as ``chat``).

        Special tokens come only from the template: written in a message (a user forging ``<|im_start|>system``)
        they are text, unless ``allow_special_tokens=True``.
        """
        self._open("chat_prompt")
        if not isinstance(allow_special_tokens, bool):
            raise ArgumentError(f"LLM.chat_prompt: allow_special_tokens must be a bool, got {allow_special_tokens!r}")
        return self.chat_setup(messages, allow_special_tokens=allow_special_tokens, **options).prompt_ids

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: str = "last",
              normalize: bool = True) -> torch.Tensor:
        """Embeddings of prompts (text or token ids): the final hidden states (after the last norm) pooled over
        each prompt ("last" token or "mean"), L2-normalized; [len(prompts), hidden] float32. Batched on the engine
        with whatever else it runs."""
        self._open("embed")
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ArgumentError("LLM.embed: no prompts")
        check_pooling(pooling)
        ids = [self._encode(p, i) for i, p in enumerate(prompts)]
        base = request_base()
        done: dict[str, Any] = {}
        e = self.engine
        for i, p in enumerate(ids):
            e.add_embedding(f"{base}{i}", p, pooling, done.__setitem__, normalize, group=base, force=True)
        e.run_until(lambda: len(done) == len(ids))
        vectors = [done[f"{base}{i}"] for i in range(len(ids))]
        for v in vectors:
            if isinstance(v, BaseException):
                raise v
        return torch.stack(vectors)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """The text of one prompt's completion (n = 1), piece by piece as each step makes it."""
        self._open("stream")
        params = [params or SamplingParams()]
        if params[0].n != 1:
            raise ArgumentError(f"LLM.stream: n = {params[0].n}; it streams one choice (use generate's on_text)")
        outs = self._requests([prompt], params)
        return (piece for pieces in self._run(outs, params) for _, piece in pieces)

    @torch.no_grad()
    def logits(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Logits of every position of one sequence: [T, vocab] float32; a full forward pass of its own."""
        self._open("logits")
        ids = self._check_ids(list(token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids), 0)
        e, step = self.engine, self.engine.scheduler.config.max_num_batched_tokens
        with e.drive_lock:  # no engine step runs meanwhile; the blocks and state slot are borrowed and given back
            need = e.blocks.blocks_for(len(ids))
            if need > e.blocks.num_free:
                raise ModelError(f"LLM.logits: {len(ids)} tokens need {need} cache blocks, {e.blocks.num_free} free")
            blocks = e.blocks.allocate(need)
            state = []
            if self.cache.has_state:
                state = [self.cache.scratch]
                self.cache.reset_state(self.cache.scratch)
            try:
                out = []
                for at in range(0, len(ids), step):
                    chunk = ids[at:at + step]
                    plan = StepPlan(chunk, [len(chunk)], [at], [blocks], state)
                    out.append(self.executor.step(plan, all_logits=True))
                return torch.cat(out)
            finally:
                e.blocks.free(blocks)

    # -- generation -------------------------------------------------------------------------------

    def _requests(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[RequestOutput]:
        return new_requests(prompts, params, self._encode)

    def _run(self, outs: list[RequestOutput], params: list[SamplingParams]) -> Iterator[list[tuple[int, str]]]:
        """``outputs.run_requests`` on this LLM's engine; ``stats`` is the call's when it ends."""
        self.stats = yield from run_requests(self.engine, self.tokenizer, self.eos_token_ids, outs, params)

    def _agree(self, tokens: list[int]) -> list[int]:
        """Every rank takes rank 0's sampled tokens (SPMD)."""
        t = torch.tensor(tokens, dtype=torch.int64, device=self.device.torch)
        self.executor.comm.broadcast(self.executor.local_ids[0], t, t, src=0)  # a lost peer: CommunicationError
        return t.tolist()

    _closed = False

    def _open(self, what: str) -> None:
        if self._closed:
            raise DtorchError(f"LLM.{what}: this LLM is closed (close() was called) and its streams are gone; load a "
                              "new LLM to use the model again")

    def need_tokenizer(self, what: str) -> Any:
        """The tokenizer, for ``what`` ("text prompts", "chat" ...); a ``ModelError`` saying what is missing (and why
        the file's vocabulary could not be built, where that is the cause) when the model has none."""
        if self.tokenizer is None:
            raise ModelError(no_tokenizer_message(self.source, what, self.tokenizer_error))
        return self.tokenizer

    def _encode(self, prompt: Prompt, index: int) -> list[int]:
        if isinstance(prompt, str):
            check_text(prompt, f"LLM.generate: prompt {index}")
            tokenizer = self.need_tokenizer("text prompts")
            self.engine.check_length(tokenizer.min_tokens(prompt), f"LLM: prompt {index}", at_least=True)
            ids = tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise ArgumentError(f"LLM.generate: prompt {index} must be a str or a list of token ids, "
                                f"got {type(prompt).__name__}")
        return self._check_ids(ids, index)

    def _check_ids(self, ids: list[int], index: int) -> list[int]:
        return self.engine.check_prompt(ids, f"LLM: prompt {index}")
