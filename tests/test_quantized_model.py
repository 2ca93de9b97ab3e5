"""Weights kept in GGUF block formats: the layout in graphs and kernel keys, and the default model run on them
(native kernels where they load, the dequantizing torch reference otherwise) against its dequantized form."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import DeviceMesh, LogicalGraph, Replicate, Runner, Shard
from dtorch.core.memory import MemoryKind
from dtorch.dispatch import KernelKey
from dtorch.kernels import layouts
from dtorch.runtime.blob import Blob, DistTensor

TEXT = (
    "The history of the city begins with a small fishing village on the northern bank of the river. Over the "
    "centuries, merchants arrived from the south and built warehouses along the water, and the village grew into "
    "a market town. In the twelfth century the town received a charter from the king, which allowed it to hold a "
    "weekly market and to collect tolls on the bridge. The cathedral was begun in the same period and took more "
    "than two hundred years to complete. During the industrial revolution, textile mills were built along the "
    "canal, and the population grew from ten thousand to more than a hundred thousand people in fifty years. "
    "Today the city is known for its university, its museums and its parks, and it attracts visitors from all "
    "over the world who come to see the old town, walk along the river and taste the local food, which is famous "
    "for its cheeses, its breads and its beers. The climate is mild, with cool summers and wet winters, and the "
    "surrounding countryside is green and hilly, with many small farms and villages connected by narrow roads. "
    "In recent years the city council has invested in public transport, building a new tram line that connects "
    "the railway station with the hospital and the university campus, and it has planted thousands of trees "
    "along the main avenues. Local schools teach children about the history of the region, and every summer "
    "a festival of music and theatre fills the squares with performers, families and students on holiday."
)


def _quantized(n: int, k: int, kind: gguf.GGMLQuantizationType, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(GGUF bytes uint8 [n, row bytes], the float32 weight [n, k] those bytes hold) via the gguf package."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy()
    raw = gguf.quants.quantize(w, kind)
    dq = torch.from_numpy(np.array(gguf.quants.dequantize(raw, kind), dtype=np.float32)).reshape(n, k)
    return torch.from_numpy(np.ascontiguousarray(raw)).view(torch.uint8).reshape(n, -1), dq


def _packed(mesh: DeviceMesh, raw: torch.Tensor, layout: str, n: int, k: int, placement) -> DistTensor:
    blobs = {}
    for r, i in enumerate(mesh.ids):
        if isinstance(placement, Shard) and placement.dim == 0:
            rows = n // mesh.size
            piece, k_local = raw[r * rows:(r + 1) * rows], k
        elif isinstance(placement, Shard):
            per = raw.shape[1] // mesh.size
            piece, k_local = raw[:, r * per:(r + 1) * per], k // mesh.size
        else:
            piece, k_local = raw, k
        blobs[i] = Blob(mesh.device(i), MemoryKind.PERSISTENT, layouts.pack(piece.contiguous(), layout, k_local),
                        pinned=True)
    return DistTensor(mesh, placement, (n, k), torch.float32, blobs, layout=layout)


@pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
@pytest.mark.parametrize(("devices", "placement"), [(1, Replicate()), (2, Shard(0)), (2, Shard(1))],
                         ids=["one", "column-parallel", "row-parallel"])
def test_a_block_format_weight_in_a_graph(devices, placement, native):
    n, k, t = 64, 256, 5
    raw, dq = _quantized(n, k, gguf.GGMLQuantizationType.Q8_0)
    mesh = DeviceMesh.cpu(devices)
    w = _packed(mesh, raw, "gguf.q8_0", n, k, placement)
    g = LogicalGraph(mesh)
    x = g.input("x", (t, k))
    wop = g.param("w", w)
    assert wop.layout == "gguf.q8_0" and wop.shape == (n, k)
    y = g.call("matmul.linear", x, wop, None)
    assert y.producer.layout == "gguf.q8_0"
    g.output("y", g.redistribute(y, Replicate()))
    xv = torch.randn(t, k)
    off = () if native else ("native",)
    with dtorch.dispatcher.disabled(*off), Runner(g) as runner:
        got = runner.run({"x": xv})["y"]
    want = F.linear(xv, dq)
    # the native kernels quantize these 5 rows to two int8 levels per block of 32 (~16 bits; NMSE ~5e-10, see
    # tests/test_native_kernels.py; a batch of decodes takes one level, as llama.cpp's int8 activations: ~3e-5); the
    # reference is exact up to float rounding
    nmse = ((got - want) ** 2).sum() / (want ** 2).sum()
    assert nmse < (1e-8 if native else 1e-10), f"NMSE {nmse:.2e}"


def test_a_block_format_weight_does_not_move_view_or_split():
    raw, _ = _quantized(64, 256, gguf.GGMLQuantizationType.Q4_0)
    mesh = DeviceMesh.cpu(2)
    g = LogicalGraph(mesh)
    w = g.param("w", _packed(mesh, raw, "gguf.q4_0", 64, 256, Shard(0)))
    with pytest.raises(dtorch.GraphError, match="gguf.q4_0 weight placed S\\(0\\); it cannot move"):
        g.redistribute(w, Replicate())
    with pytest.raises(dtorch.GraphError, match="packed bytes"):
        g.view(w, (256, 64))
    with pytest.raises(dtorch.GraphError, match="packed bytes"):
        g.split(w, (32, 32), 0)
    g.output("y", g.call("binary.add", w, w))
    with pytest.raises(dtorch.KernelNotFound, match="binary.add on cpu/float32/gguf.q4_0"):
        Runner(g)  # no kernel of binary.add reads a block format


def test_the_quantized_keys_are_listed():
    rows = [r for r in dtorch.dispatcher.table("cpu") if r.key.layout == "gguf.q4_1"]
    assert {r.key.op for r in rows} >= {"matmul.linear", "llm.embedding"}
    assert any(r.provider == "reference" for r in rows)
    exp = dtorch.dispatcher.explain(KernelKey("matmul.linear", "cpu", torch.float32, "gguf.q4_1"))
    assert "linear_dequantized[gguf.q4_1]" in str(exp)


# -- the default model -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models():
    from dtorch.engine.llm import LLM

    quantized, floats = LLM(), LLM(dequantize=True)
    yield quantized, floats
    quantized.close()
    floats.close()


def test_the_default_model_keeps_its_weights_as_stored(models):
    quantized, floats = models
    layouts_used = {w.layout for w in quantized.model.weights.values()}
    assert {"gguf.q4_1", "gguf.q8_0"} <= layouts_used
    assert quantized.model.weights["lm_head"] is quantized.model.weights["embed"]  # tied: one copy
    assert {w.layout for w in floats.model.weights.values()} == {"strided"}
    assert quantized.model.weight_bytes() < 0.25 * floats.model.weight_bytes()


@pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
def test_the_quantized_model_agrees_with_its_dequantized_form(models, native):
    quantized, floats = models
    ids = quantized.tokenizer.encode(TEXT)[:256]
    assert len(ids) == 256
    want = floats.logits(ids).argmax(-1)
    with dtorch.dispatcher.disabled(*(() if native else ("native",))):
        got = quantized.logits(ids).argmax(-1)
    agree = (got == want).float().mean().item()
    assert agree >= 0.97, f"top-1 agreement {agree:.3f} over 256 positions"


def _stepwise_logits(llm, ids: list[int]) -> torch.Tensor:
    """Logits of every position computed one token per step, as decode runs (each product has one row, which
    the native kernels compute on integer activations; a whole-text pass takes their float path instead). A step of
    one token is a decode bucket only without ``all_logits`` (which pads the step to 16 prompt rows, ten times the
    CPU time a step); its one row's logits are the step's output either way."""
    from dtorch.models.executor import StepPlan

    blocks = llm.engine.blocks.allocate(llm.engine.blocks.blocks_for(len(ids)))
    try:
        rows = []
        for at, token in enumerate(ids):
            rows.append(llm.executor.step(StepPlan([token], [1], [at], [blocks])))
        return torch.cat(rows)
    finally:
        llm.engine.blocks.free(blocks)


def test_the_decode_path_agrees_with_the_dequantized_form(models):
    quantized, floats = models
    ids = quantized.tokenizer.encode(TEXT)[:256]
    want = floats.logits(ids).argmax(-1)
    agree = (_stepwise_logits(quantized, ids).argmax(-1) == want).float().mean().item()
    assert agree >= 0.97, f"top-1 agreement {agree:.3f} over 256 one-token steps"


def _spying(key: KernelKey):
    """A kernel registered over ``key``'s winner that records (rows, params.coarse) of each call; unregister after."""
    below = dtorch.dispatcher.select(key)
    seen = []

    def spy(ctx, inputs, outputs):
        seen.append((inputs[0].shape[0], ctx.params.get("coarse", False)))
        below.fn(ctx, inputs, outputs)

    dtorch.dispatcher.register(key, spy, provider="user")
    return seen


def test_long_prompts_and_decode_batches_are_coarse_verified_rows_and_logits_are_not(models):
    """matmul.linear's ``coarse`` param (the native GGUF kernels then round x to one int8 level from 4 rows) reaches a
    plugged-in kernel on a prompt step of COARSE_PROMPT_ROWS rows and more whose prompts all have that many tokens, and
    on a step of decodes (whose kernel keeps two levels under 4 rows); never on a shorter prompt step, on a step as
    long that short prompts fill or that holds a short prompt beside a long one, on the rows of every position's
    logits (``logits``) or on the rows a speculative step verifies."""
    from dtorch.engine.llm import LLM
    from dtorch.engine.sampling import SamplingParams
    from dtorch.models.bucket import COARSE_PROMPT_ROWS

    quantized, _ = models
    key = KernelKey("matmul.linear", "cpu", torch.float32, "gguf.q4_1")
    seen = _spying(key)
    try:
        prompts = ["Hello there, how", "The capital of France is", "One, two, three,", "Once upon a time there"]
        quantized.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        # the prompts' step (its rows padded to 32), then two decode steps of the four
        assert {(rows, coarse) for rows, coarse in seen} == {(32, False), (4, True)}
        seen.clear()
        ids = quantized.tokenizer.encode(TEXT)
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        quantized.generate([ids[:COARSE_PROMPT_ROWS]], one)
        assert seen and {(rows, coarse) for rows, coarse in seen} == {(COARSE_PROMPT_ROWS, True)}
        seen.clear()
        # a step of 128 rows (padded) that short prompts fill, and one that holds a short prompt beside a long one
        quantized.generate([ids[i:i + 12] for i in range(0, 120, 12)], one)
        quantized.generate([ids[1:COARSE_PROMPT_ROWS + 1], ids[150:162]], one)  # no prefix cached before
        assert {rows for rows, coarse in seen} == {COARSE_PROMPT_ROWS, 2 * COARSE_PROMPT_ROWS}
        assert not any(coarse for rows, coarse in seen)
        seen.clear()
        quantized.logits(quantized.tokenizer.encode(TEXT)[:40])
        assert seen and not any(coarse for rows, coarse in seen)
    finally:
        dtorch.dispatcher.unregister(key, "user")
    text = "one two three four five six seven eight nine ten one two three four five six seven eight nine ten"
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = quantized.generate([text * 7], greedy)
    spec = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    seen = _spying(key)
    try:
        # a long prompt's step drafts nothing, and stays coarse; the steps after it verify drafts
        out = spec.generate([text * 7], greedy)
        assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
        assert (2 * COARSE_PROMPT_ROWS, True) in seen
        assert [rows for rows, coarse in seen if 1 < rows < 16 and not coarse]
        assert not any(coarse for rows, coarse in seen if 1 < rows < 16)
        # a short prompt's step verifies drafts beside its rows, which then keep two levels as well (a prompt that
        # shares no cached prefix with the one before)
        seen.clear()
        spec.generate([text.replace("one", "eleven")], greedy)
        assert len({rows for rows, coarse in seen}) >= 2 and not any(coarse for rows, coarse in seen if rows > 1)
    finally:
        dtorch.dispatcher.unregister(key, "user")
        spec.close()


def _prompt_logits(llm, ids: list[int]) -> torch.Tensor:
    """The last row's logits of ``ids`` run as one long prompt's step (coarse rows from COARSE_PROMPT_ROWS rows,
    padded, unless the model is batch invariant)."""
    from dtorch.models.executor import StepPlan

    blocks = llm.engine.blocks.allocate(llm.engine.blocks.blocks_for(len(ids)))
    try:
        return llm.executor.step(StepPlan(list(ids), [len(ids)], [0], [blocks], long=True))[-1]
    finally:
        llm.engine.blocks.free(blocks)


def test_a_long_prompts_8_bit_activations_keep_the_next_token(models):
    """A long prompt's rows take one int8 level per 32 values on AVX-512 VNNI (as llama.cpp's activations; the
    batch-invariant model keeps two, about 16 bits; other CPUs take exact float panels from 32 rows): at the end of
    prefixes of a real text, the logits move from the exact product's (the dequantized model) by a few percent, not by
    the size of the logits as a wrong product would, and the next token is the exact product's as often as the two
    levels' is, but for one prefix."""
    from dtorch.engine.llm import LLM
    from dtorch.kernels.native import loader

    quantized, floats = models
    precise = LLM(batch_invariant=True)
    try:
        ids = quantized.tokenizer.encode(TEXT)[:256]
        moved, two, top = [], [], {"coarse": 0, "precise": 0}
        for n in range(72, 129, 8):  # steps of 128 rows, coarse
            want, coarse, fine = (_prompt_logits(m, ids[:n]) for m in (floats, quantized, precise))
            moved.append(float((coarse - want).norm() / want.norm()))
            two.append(float((fine - want).norm() / want.norm()))
            top["coarse"] += int(coarse.argmax() == want.argmax())
            top["precise"] += int(fine.argmax() == want.argmax())
        # measured on AVX-512 VNNI: 1.5-9% against the two levels' 0.005-0.03%
        assert max(moved) < 0.15 and max(two) < 0.01, (moved, two)
        if loader.unavailable_reason() is None and loader.isa() == "avx512":
            assert min(moved) > 0.001, moved
        assert top["coarse"] >= top["precise"] - 1 and top["coarse"] >= len(moved) - 2, top
    finally:
        precise.close()


def _decode_logits(llm, rows: list[int], at: int, blocks: list) -> torch.Tensor:
    from dtorch.models.executor import StepPlan

    n = len(rows)
    return llm.executor.step(StepPlan(rows, [1] * n, [at] * n, blocks[:n]))


def test_a_sequence_decoded_in_a_batch_is_bit_identical_only_when_batch_invariant(models):
    """A batch of 8 decodes against the first sequence decoded alone: batch invariant, its logits are the same bits;
    by default the products of the batch take one int8 level (llama.cpp's activations), close to the two levels of
    a lone decode but not equal."""
    from dtorch.engine.llm import LLM

    default, _ = models
    invariant = LLM(batch_invariant=True)
    try:
        assert invariant.model.batch_invariant and not default.model.batch_invariant
        ids = default.tokenizer.encode(TEXT)[:24]
        for llm, same in ((invariant, True), (default, False)):
            blocks = [llm.engine.blocks.allocate(llm.engine.blocks.blocks_for(32)) for _ in range(8)]
            try:
                for at, token in enumerate(ids[:-1]):  # the context: 8 copies of one prefix
                    _decode_logits(llm, [token] * 8, at, blocks)
                alone = _decode_logits(llm, [ids[-1]], len(ids) - 1, blocks)[0]
                batch = _decode_logits(llm, [ids[-1]] + [ids[0]] * 7, len(ids) - 1, blocks)[0]
            finally:
                for b in blocks:
                    llm.engine.blocks.free(b)
            rel = float((batch - alone).norm() / alone.norm())
            if same:
                assert torch.equal(batch, alone)
            else:
                # 8-bit rounding noise of 24 steps, one realization per ISA (4.8% on AVX2, 5.7% on AVX-512 VNNI when
                # measured); a wrong product is of the order of the logits themselves
                assert 0 < rel < 0.1, f"one level vs two: relative difference {rel:.2e}"
    finally:
        invariant.close()


def test_the_quantized_model_still_knows_paris(models):
    quantized, _ = models
    from dtorch.engine.sampling import SamplingParams

    out = quantized.chat([{"role": "user", "content": "What is the capital of France?"}],
                         SamplingParams(temperature=0.0, max_tokens=24))
    assert "Paris" in out[0].outputs[0].text


def test_tensor_parallel_on_block_format_weights(models):
    """Row- and column-parallel pieces packed per device (K split on three devices for o and down): through the
    reference kernels the logits equal one device's up to summation order; native kernels agree at top-1."""
    from dtorch.engine.llm import LLM

    quantized, _ = models
    ids = quantized.tokenizer.encode(TEXT)[:48]
    tp = LLM(tensor_parallel_size=3)
    try:
        assert tp.model.weights["layers.0.o"].layout == "gguf.q4_1"
        assert tp.model.weights["layers.0.o"].placement == Shard(1, None, 192)
        with dtorch.dispatcher.disabled("native"):
            torch.testing.assert_close(tp.logits(ids), quantized.logits(ids), rtol=1e-4, atol=1e-3)
        got, want = tp.logits(ids), quantized.logits(ids)
    finally:
        tp.close()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95
