"""No host syncs in a model step: ``forbid_host_sync()`` / ``DTORCH_FORBID_SYNC``, the accuracy of
``KernelMeta.capture_safe`` for every cpu kernel, and a decode step of a tiny Qwen3 run under the mode."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch

import dtorch
from dtorch import ops
from dtorch.core import env, hostsync
from dtorch.core.device import Device
from dtorch.core.dtypes import GGUF_LAYOUTS, GGUF_X16_LAYOUTS
from dtorch.core.errors import ConfigError, SyncError
from dtorch.dispatch.context import KernelContext, KernelParams
from dtorch.dispatch.key import KernelKey
from dtorch.dispatch.meta import Call
from dtorch.kernels import layouts
from dtorch.kernels.half import HALF_LAYOUTS
from dtorch.ops import _checks
from dtorch.runtime import KernelStream, StreamType
from tests.op_table import ROWS
from tests.op_table_llm import LLM_ROWS

forbid = hostsync.forbid_host_sync
T = torch.tensor([1, 0, 2])
S = torch.tensor(3)
F = torch.ones(3)
MASK = T > 0

# -- the mode -------------------------------------------------------------------------------------------------------

READS: dict[str, Callable[[], object]] = {
    "tolist": lambda: T.tolist(), "item": lambda: S.item(), "bool": lambda: bool(S), "if": lambda: 1 if S else 0,
    "int": lambda: int(S), "float": lambda: float(S), "index": lambda: range(S), "complex": lambda: complex(S),
    "numpy": lambda: T.numpy(), "np.asarray": lambda: np.asarray(T), "in": lambda: 1 in T,
    "nonzero": lambda: T.nonzero(), "torch.nonzero": lambda: torch.nonzero(T), "argwhere": lambda: torch.argwhere(T),
    "where(cond)": lambda: torch.where(T), "masked_select": lambda: T.masked_select(MASK),
    "unique": lambda: T.unique(), "unique_consecutive": lambda: torch.unique_consecutive(T),
    "bincount": lambda: torch.bincount(T), "repeat_interleave(tensor)": lambda: F.repeat_interleave(T),
    "repeat_interleave(repeats)": lambda: torch.repeat_interleave(T), "mask get": lambda: F[MASK],
    "mask set": lambda: F.__setitem__(MASK, 0.0), "mask in a tuple": lambda: F[(MASK,)],
    "equal": lambda: torch.equal(T, T), "allclose": lambda: torch.allclose(F, F), "is_nonzero": lambda: S.is_nonzero(),
    "builtin max": lambda: max(T),
}
ALLOWED: dict[str, Callable[[], object]] = {
    "int index": lambda: F[T], "repeat_interleave(int)": lambda: F.repeat_interleave(2),
    "repeat_interleave(output_size)": lambda: torch.repeat_interleave(F, T, output_size=3),
    "where(cond, a, b)": lambda: torch.where(MASK, F, 0.0), "index_copy_": lambda: F.clone().index_copy_(0, T, F),
    "masked_fill": lambda: F.masked_fill(MASK, 0), "cpu of a cpu tensor": lambda: T.cpu(),
    "to cpu of a cpu tensor": lambda: T.to("cpu"), "slice": lambda: F[1:2], "int": lambda: F[0],
    "empty": lambda: torch.empty(3), "sum": lambda: F.sum(), "shape": lambda: F.shape[0] + len(F),
    "argmax": lambda: T.argmax(), "any": lambda: MASK.any(),
}


@pytest.mark.parametrize("name", sorted(READS))
def test_each_host_read_raises(name):
    with forbid(), pytest.raises(SyncError):
        READS[name]()


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_device_work_is_allowed(name):
    with forbid():
        ALLOWED[name]()


def test_off_by_default_and_the_error_names_the_call_and_its_caller(monkeypatch):
    monkeypatch.delenv("DTORCH_FORBID_SYNC", raising=False)
    assert not env.forbid_sync()
    monkeypatch.setattr(hostsync, "_FLAG", False)
    monkeypatch.setattr(hostsync, "ON", False)
    assert not hostsync.forbidding()
    assert T.tolist() == [1, 0, 2]
    with forbid(), forbid():  # nested regions are one
        assert hostsync.forbidding() and hostsync.ON
        with pytest.raises(SyncError, match=r"Tensor\.tolist .* in test_off_by_default"):
            T.tolist()
    assert not hostsync.forbidding() and not hostsync.ON
    assert T.tolist() == [1, 0, 2]


def test_the_env_flag_is_read_and_checked(monkeypatch):
    monkeypatch.setenv("DTORCH_FORBID_SYNC", "1")
    assert env.forbid_sync()
    monkeypatch.setenv("DTORCH_FORBID_SYNC", "sometimes")
    with pytest.raises(ConfigError, match="DTORCH_FORBID_SYNC"):
        env.check()


class _Read:
    """A stream item that reads a tensor on the host and records what happened."""

    label = "read"

    def __init__(self) -> None:
        self.result = None

    def execute(self, stream, state):
        try:
            T.tolist()
            self.result = "read"
        except SyncError:
            self.result = "raised"


def _on_stream(stream: KernelStream) -> str:
    item = _Read()
    stream.push(item)
    assert stream.synchronize(5.0)
    return item.result


def test_the_mode_is_per_thread_and_the_streams_cover_their_own(monkeypatch):
    """torch function modes are thread-local: a region covers its own thread only, so a kernel stream enters the
    mode itself for each item while any region is open (or DTORCH_FORBID_SYNC is set)."""
    seen = []
    stream = KernelStream(Device("cpu", 0), StreamType.COMPUTE)
    try:
        with forbid():
            th = threading.Thread(target=lambda: seen.append(T.tolist()))
            th.start()
            th.join()
            assert seen == [[1, 0, 2]]  # a plain thread is not covered
            assert _on_stream(stream) == "raised"
        assert _on_stream(stream) == "read"
        monkeypatch.setattr(hostsync, "_FLAG", True)  # what DTORCH_FORBID_SYNC=1 sets at import
        monkeypatch.setattr(hostsync, "ON", True)
        assert _on_stream(stream) == "raised"
        assert T.tolist() == [1, 0, 2]  # the flag covers the streams, not the caller's own code
    finally:
        stream.close()


def test_wrappers_read_values_only_where_that_is_free():
    """Wrappers validate values on cpu only, never under the mode: device values are trusted (validated where
    they are made); on cpu a bad value still raises outside the mode."""
    assert _checks.host_readable(T) and not _checks.host_readable(T.to("meta"))
    kc = torch.zeros(4, 4, 2, 16)
    vc = torch.zeros_like(kc)
    key = torch.randn(2, 2, 16)
    with pytest.raises(dtorch.ArgumentError, match="slot"):
        ops.reshape_and_cache(key, key, kc, vc, torch.tensor([3, 99]))
    with forbid():
        assert not _checks.host_readable(T)
        ops.reshape_and_cache(key, key, kc, vc, torch.tensor([3, -1]))
        i32 = torch.int32
        out = ops.flash_attention_with_kvcache(torch.randn(2, 4, 16), kc, vc, torch.tensor([0, 1, 2], dtype=i32),
                                               torch.tensor([4, 0], dtype=i32), torch.tensor([[0], [1]], dtype=i32))
        ops.embedding(torch.tensor([1, 2]), torch.randn(5, 8))
    assert torch.equal(kc.flatten(0, 1)[3], key[0]) and torch.equal(out[1], torch.zeros_like(out[1]))


# -- capture_safe is accurate --------------------------------------------------------------------------------------
# Every cpu candidate of every op runs under the mode on the op table's inputs (tests/op_table*.py) and, for the ops
# the table does not run, on the inputs below: a capture-safe kernel must not raise SyncError on any call its
# capability check accepts, and a kernel marked not capture-safe must raise on at least one.

Run = tuple[list, list, dict]  # (inputs, outputs, params); fresh tensors per call (some kernels write in place)


def _kv_write() -> Run:
    kc = torch.zeros(4, 4, 2, 16)
    return [torch.randn(3, 2, 16), torch.randn(3, 2, 16), kc, kc.clone(), torch.tensor([5, -1, 9])], [], {}


def _kv_attention(cu: list[int], lens: list[int], table: list[list[int]]) -> Callable[[], Run]:
    def make() -> Run:
        kc = torch.randn(6, 4, 2, 16)
        q = torch.randn(cu[-1], 4, 16)
        i32 = torch.int32
        inputs = [q, kc, torch.randn_like(kc), torch.tensor(cu, dtype=i32), torch.tensor(lens, dtype=i32),
                  torch.tensor(table, dtype=i32)]
        return inputs, [torch.empty_like(q)], {"causal": True, "scale": 0.25}
    return make


def _gdn(varlen: bool) -> Callable[[], Run]:
    def make() -> Run:
        b, t, n = (1, 5, 2) if varlen else (2, 1, 2)
        q, k = torch.randn(b, t, 2, 16), torch.randn(b, t, 2, 16)
        v, g, beta = torch.randn(b, t, 4, 16), -torch.rand(b, t, 4), torch.rand(b, t, 4)
        state = torch.randn(n, 4, 16, 16)
        cu = torch.tensor([0, 2, 5], dtype=torch.int32) if varlen else None
        params = {"scale": None, "use_qk_l2norm": True, "mode": "chunked", "chunk_size": 64}
        return [q, k, v, g, beta, state, cu], [torch.empty_like(v), torch.empty_like(state)], params
    return make


def _conv() -> Run:
    x = torch.randn(2, 8, 5)
    return ([x, torch.randn(8, 4), torch.randn(8), torch.randn(2, 8, 3)],
            [torch.empty_like(x), torch.empty(2, 8, 3)], {"activation": "silu"})


def _conv_update() -> Run:
    x, pool = torch.randn(2, 8), torch.randn(3, 8, 4)
    return ([x, torch.randn(8, 4), torch.randn(8), pool, torch.tensor([2, 0])], [torch.empty_like(x), pool],
            {"activation": "silu"})


def _conv_varlen() -> Run:
    x, pool = torch.randn(5, 8), torch.randn(3, 8, 4)
    return ([x, torch.randn(8, 4), torch.randn(8), pool, torch.tensor([0, 2, 5], dtype=torch.int32),
             torch.tensor([2, 0])], [torch.empty_like(x), pool], {"activation": "silu"})


def _gates() -> Run:
    a = torch.randn(3, 4)
    return [a, torch.randn(3, 4), torch.randn(4), torch.randn(4)], [torch.empty(3, 4), torch.empty(3, 4)], {}


def _add_rms_norm() -> Run:
    x = torch.randn(3, 8)
    return [x, torch.randn(3, 8), torch.randn(8)], [torch.empty_like(x), torch.empty_like(x)], {"eps": 1e-6}


def _router() -> Run:
    return ([torch.randn(3, 8)], [torch.empty(3, 2), torch.empty(3, 2, dtype=torch.int64)],
            {"top_k": 2, "norm_topk_prob": True})


def _packed(layout: str, rows: int, k: int) -> torch.Tensor:
    """Random GGUF bytes packed for ``layout``: the values do not matter here, only which reads a kernel makes."""
    import gguf

    name = layouts.row_layout(layout).removeprefix("gguf.").upper()
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    raw = torch.randint(0, 256, (rows, k // block * size), dtype=torch.uint8)
    return layouts.pack(raw, layout, k)


def _qlinear(layout: str) -> Callable[[], Run]:
    return lambda: ([torch.randn(2, 256), _packed(layout, 8, 256), None], [torch.empty(2, 8)], {})


def _x16linear(layout: str) -> Callable[[], Run]:  # whole groups of 16 rows
    return lambda: ([torch.randn(2, 256), _packed(layout, 16, 256), None], [torch.empty(2, 16)], {})


def _qembedding(layout: str) -> Callable[[], Run]:
    return lambda: ([_packed(layout, 16, 256), torch.tensor([3, 0, 15])], [torch.empty(3, 256)], {})


def _hlinear(layout: str) -> Callable[[], Run]:
    return lambda: ([torch.randn(2, 64), torch.randn(8, 64).to(HALF_LAYOUTS[layout]), None], [torch.empty(2, 8)], {})


def _hembedding(layout: str) -> Callable[[], Run]:
    w = torch.randn(16, 64).to(HALF_LAYOUTS[layout])
    return lambda: ([w, torch.tensor([3, 0, 15])], [torch.empty(3, 64)], {"vocab_start": 2})


# (op, layout) -> input makers (float32; the table's ops run every dtype of their rows)
EXTRA: dict[tuple[str, str], list[Callable[[], Run]]] = {
    ("llm.reshape_and_cache", "strided"): [_kv_write],
    ("llm.flash_attention_with_kvcache", "strided"): [
        _kv_attention([0, 3, 4], [5, 2], [[1, 2], [3, 0]]),     # a chunked prefill and a decode
        _kv_attention([0, 1, 2, 2], [7, 1, 0], [[4, 5], [0, 0], [0, 0]]),  # decode with an empty sequence
    ],
    ("llm.gated_delta_net", "strided"): [_gdn(False), _gdn(True)],
    ("llm.causal_conv1d", "strided"): [_conv],
    ("llm.causal_conv1d_update", "strided"): [_conv_update],
    ("llm.causal_conv1d_varlen", "strided"): [_conv_varlen],
    ("llm.gdn_gates", "strided"): [_gates],
    ("llm.add_rms_norm", "strided"): [_add_rms_norm],
    ("llm.moe_router", "strided"): [_router],
    **{("matmul.linear", lay): [_qlinear(lay)] for lay in GGUF_LAYOUTS},
    **{("llm.embedding", lay): [_qembedding(lay)] for lay in GGUF_LAYOUTS},
    **{("matmul.linear", lay): [_x16linear(lay)] for lay in GGUF_X16_LAYOUTS},
    **{("matmul.linear", lay): [_hlinear(lay)] for lay in HALF_LAYOUTS},
    **{("llm.embedding", lay): [_hembedding(lay)] for lay in HALF_LAYOUTS},
}

# Kernels marked not capture-safe that read nothing on every input here, each with the reason (none today).
QUIET: dict[tuple[str, str], str] = {}


def _table_runs(op: str):
    """(key, run maker) of every row, dtype and case of the op tables for ``op``."""
    for row in ROWS + LLM_ROWS:
        if row.op != op:
            continue
        for dt in row.dtypes:
            for case in row.cases:
                def make(row=row, dt=dt, case=case) -> Run:
                    inputs, params = row.make_inputs(dt, case), row.params_for(dt, case)
                    want = row.reference(inputs, params)
                    return inputs, [torch.empty(want.shape, dtype=want.dtype)], params
                first = next((t for t in row.make_inputs(dt, case) if isinstance(t, torch.Tensor)), None)
                yield KernelKey(op, "cpu", first.dtype if first is not None else dt), make


def _runs(op: str, layout: str):
    if layout == "strided":
        yield from _table_runs(op)
    for make in EXTRA.get((op, layout), ()):
        inputs, outputs, _ = make()
        dtype = next(t.dtype for t in outputs + inputs if isinstance(t, torch.Tensor) and t.is_floating_point())
        yield KernelKey(op, "cpu", dtype, layout), make


def _ops() -> list[tuple[str, str]]:
    keys = {(k.op, k.layout) for k in dtorch.dispatcher.keys("cpu")}
    return sorted(keys)


@pytest.mark.parametrize(("op", "layout"), _ops(), ids=[f"{o}[{lay}]" for o, lay in _ops()])
def test_capture_safe_is_accurate(op, layout):
    reads: dict[str, list[str]] = {}  # provider -> the calls on which it read on the host
    runs = list(_runs(op, layout))
    assert runs, f"{op} [{layout}]: neither the op table nor EXTRA makes inputs for it"
    safe: dict[str, bool] = {}
    for key, make in runs:
        for cand in dtorch.dispatcher.candidates(key):
            inputs, outputs, params = make()
            call = Call(Device("cpu"), key.dtype, KernelParams(**params), inputs)
            if cand.check is not None and cand.check(call) is not None:
                continue  # capture_safe describes the calls a candidate accepts
            safe[cand.provider] = cand.meta.capture_safe
            reads.setdefault(cand.provider, [])
            if not outputs:  # reshape_and_cache writes the caches it takes
                outputs = inputs[2:4]
            ctx = KernelContext(Device("cpu"), params=KernelParams(**params))
            try:
                with forbid():
                    cand.fn(ctx, inputs, outputs)
            except SyncError as exc:
                reads[cand.provider].append(f"{key}: {exc}".split(", inside")[0])
    for provider, calls in reads.items():
        if safe[provider]:
            assert not calls, f"{op}/{provider} is marked capture-safe but reads on the host: {calls[:2]}"
        elif (op, provider) not in QUIET:
            assert calls, f"{op}/{provider} is marked not capture-safe but read nothing on these inputs"


# -- a decode step under the mode -----------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from dtorch.engine.llm import LLM
    from tests.tiny_models import families, save_random

    config = families(transformers, heads=4, kv_heads=2, vocab=128, qwen3_head_dim=32)["qwen3"]()
    save_random(transformers, config, path := tmp_path_factory.mktemp("qwen3"))
    llm = LLM(str(path), max_num_seqs=4)
    yield llm
    llm.close()


@pytest.mark.parametrize("disabled", [(), ("native", "sdpa")], ids=["default", "torch-kernels"])
def test_a_decode_step_runs_without_host_reads(qwen3, disabled, monkeypatch):
    """A prefill step as usual, then the same decode step without and with the mode (a region around the step, and
    the flag's own path: the streams entering the mode): the same logits, and no SyncError. The default winners on
    cpu are capture-safe; with native and cpu's per-sequence sdpa disabled (what a captured step's choice passes
    over) the torch kernels run: the padded paged attention and the sync-free cache write."""
    from dtorch.models.executor import StepPlan

    ex = qwen3.executor
    blocks = qwen3.engine.blocks.allocate(qwen3.engine.blocks.blocks_for(8))
    try:
        with dtorch.dispatcher.disabled(*disabled):
            ex.step(StepPlan([3, 4, 5], [3], [0], [blocks]))
            decode = StepPlan([6], [1], [3], [blocks])
            want = ex.step(decode)
            with forbid():
                got = ex.step(decode)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            monkeypatch.setattr(hostsync, "_FLAG", True)
            monkeypatch.setattr(hostsync, "ON", True)
            torch.testing.assert_close(ex.step(decode), want, rtol=0, atol=1e-5)
    finally:
        qwen3.engine.blocks.free(blocks)
