"""What a loaded model holds, in sizes: the KV cache and RoPE table follow the context asked for (the table holds the
rows reached so far, up to it), the step buckets share one set of buffers, packing makes no copy of a whole large
weight, and a GGUF is read without keeping the file's pages or per-string views of its metadata. (Timings and RSS
are bench/memory.py's business.)"""

from __future__ import annotations

import mmap
import os

import gguf
import numpy as np
import pytest
import torch

import dtorch
from dtorch.engine.llm import LLM
from dtorch.models import rope_rows
from tests.smaps import mapping
from tests.tiny_models import families, hf_greedy, save_random

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    config = families(transformers, heads=4, kv_heads=2, vocab=128, qwen3_head_dim=16)["llama"]()
    return save_random(transformers, config, path), str(path)


@pytest.mark.parametrize(("max_len", "seqs"), [(48, 3), (96, 3), (96, 1)])
def test_the_kv_cache_and_rope_table_follow_the_context_asked_for(tiny, max_len, seqs):
    _, path = tiny
    llm = LLM(path, max_model_len=max_len, max_num_seqs=seqs)
    try:
        assert llm.cache.num_blocks == -(-seqs * max_len // llm.cache.block_size)
        assert llm.cache.max_len == max_len and llm.model.rope_positions == max_len
        # the table holds the rows reached so far: from FIRST rows (here the context is shorter) to the context
        assert llm.model.rope_table.shape[0] == min(rope_rows.FIRST, max_len)
    finally:
        llm.close()


def test_the_rope_table_holds_the_positions_reached(tiny, monkeypatch):
    """Tables start at FIRST rows and double when a step reaches past them (the rows' values: test_rope_rows)."""
    hf, path = tiny
    monkeypatch.setattr(rope_rows, "FIRST", 16)
    llm = LLM(path, max_model_len=96, max_num_seqs=1)
    try:
        assert llm.model.rope_table.shape[0] == 16
        params = dtorch.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        prompt = [9, 11, 12, 13, 14, 15] * 5  # positions to 34: 16 -> 32 -> 64 rows
        assert llm.generate([prompt], params)[0].outputs[0].token_ids == hf_greedy(hf, prompt, 5)
        assert llm.model.rope_table.shape[0] == 64 and llm.model.rope_positions == 96
    finally:
        llm.close()


def test_every_bucket_carves_its_step_buffers_from_the_same_storage(tiny):
    hf, path = tiny
    llm = LLM(path, max_num_seqs=4, max_num_batched_tokens=64)
    try:
        params = dtorch.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        prompts = [[5, 17, 99], [3] * 40 + [7], [9, 11, 12, 13, 14, 15] * 5, [42] * 70]
        for batch in ([prompts[0]], prompts[:2], prompts):
            outs = llm.generate(batch, params)
            assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 5) for p in batch]
        runners = llm.executor.runners
        assert len(runners) >= 4
        per_bucket = [r.buffer_bytes for r in runners.values()]
        (shared,) = llm.executor.buffers.values()
        assert shared.nbytes <= 2 * max(per_bucket) < sum(per_bucket)
        slabs = {s.untyped_storage().data_ptr() for s in shared.slabs}
        for r in runners.values():  # every fresh result of every bucket lies in the shared slabs
            fresh = [r.blobs[(y.index, i)].tensor for node in r.graph.operators if node.kind == "kernel"
                     for j, y in enumerate(node.outputs) if not node.aliases or node.aliases[j] is None
                     for i in r.local_ids]
            assert fresh and all(t.untyped_storage().data_ptr() in slabs for t in fresh if t.numel())
    finally:
        llm.close()


def test_a_large_weight_is_packed_a_chunk_at_a_time(monkeypatch):
    from dtorch.kernels import layouts
    from dtorch.models import weights

    w = np.random.default_rng(0).standard_normal((100, 256)).astype(np.float32)
    raw = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1).reshape(100, -1))
    whole = layouts.pack(raw, "gguf.q4_1", 256)
    monkeypatch.setattr(weights, "PACK_CHUNK_BYTES", 7 * raw.shape[1])  # 7 rows a chunk: the last one short
    assert torch.equal(weights.pack_stored(raw, "gguf.q4_1", 256), whole)


def _write(path, tokens: list[str]) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_uint32("llama.block_count", 3)
    w.add_float32("llama.rope.freq_base", 1e4)
    w.add_string("tokenizer.chat_template", "{{ messages }}")
    w.add_array("tokenizer.ggml.merges", [f"{a} {b}" for a, b in zip(tokens, tokens[1:], strict=False)])
    w.add_tensor("big", np.ones((512, 1024), dtype=np.float32))  # 2 MiB: many pages
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_lean_reader_reads_what_gguf_reads(tmp_path):
    from dtorch.models.loaders.gguf import _open, read_metadata

    tokens = [f"tok{i}" for i in range(3000)] + ["é", "日本", ""]
    _write(tmp_path / "m.gguf", tokens)
    lean, plain = _open(tmp_path / "m.gguf"), gguf.GGUFReader(str(tmp_path / "m.gguf"))
    assert read_metadata(lean, tmp_path) == read_metadata(plain, tmp_path)
    assert [(t.name, t.tensor_type, int(t.data_offset), int(t.n_bytes)) for t in lean.tensors] == \
        [(t.name, t.tensor_type, int(t.data_offset), int(t.n_bytes)) for t in plain.tensors]
    assert np.array_equal(lean.tensors[0].data, plain.tensors[0].data)


def _mapped_kib(address: int, field: str = "Rss") -> int:
    """This process's resident KiB of the mapping that holds ``address`` (/proc/self/smaps: pages mapped here, not
    the page cache); ``field``: another of its lines, such as AnonHugePages."""
    return mapping(address)[2][field]


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")
def test_huge_pages_moves_a_large_tensor_into_2_mib_pages_in_place():
    from dtorch.core.memory import HUGE_PAGE, huge_pages

    big = torch.arange(3 << 20, dtype=torch.int32)  # 12 MiB: at least four whole aligned huge pages inside
    small = torch.arange(256 << 10, dtype=torch.int32)  # 1 MiB: none is sure to lie inside, left alone
    before = big.clone()
    done = huge_pages([big, big[5:], small])  # a storage seen twice is collapsed once
    if done == 0:  # the kernel refuses (before 6.1, or transparent huge pages "never")
        assert torch.equal(big, before)
        pytest.skip("this kernel refuses madvise(MADV_COLLAPSE)")
    assert done % HUGE_PAGE == 0 and done <= big.nbytes  # each range may be refused alone (busy pages)
    assert _mapped_kib(big.data_ptr(), "AnonHugePages") * 1024 >= done
    assert torch.equal(big, before)  # the same bytes
    assert huge_pages([small]) == 0 and huge_pages([torch.empty(8 << 20, device="meta")]) == 0


def test_huge_pages_counts_nothing_where_the_kernel_refuses(monkeypatch):
    """A kernel before 6.1 (or THP "never") answers madvise(MADV_COLLAPSE) with -1: nothing is counted, nothing
    moves; with no C library to call, nothing is tried."""
    import importlib

    memory = importlib.import_module("dtorch.core.memory")  # (the package's "memory" is the tracker)
    calls = []
    refuse = lambda addr, size, advice: calls.append((addr.value, size.value, advice)) or -1  # noqa: E731
    monkeypatch.setattr(memory, "libc_function", lambda name: refuse if name == "madvise" else None)
    big = torch.arange(3 << 20, dtype=torch.int32)
    before = big.clone()
    assert memory.huge_pages([big]) == 0 and torch.equal(big, before)
    whole = (big.data_ptr() + big.nbytes) // memory.HUGE_PAGE - -(-big.data_ptr() // memory.HUGE_PAGE)
    assert len(calls) == whole >= 4  # each whole 2 MiB page inside the storage, once
    for addr, size, advice in calls:
        assert advice == memory.MADV_COLLAPSE and addr % memory.HUGE_PAGE == 0 and size == memory.HUGE_PAGE
        assert big.data_ptr() <= addr and addr + size <= big.data_ptr() + big.nbytes  # inside the storage only
    monkeypatch.setattr(memory, "libc_function", lambda name: None)
    assert memory.huge_pages([big]) == 0


def test_no_huge_pages_leaves_the_weights_alone(tiny, monkeypatch):
    import dtorch.engine.llm as llm_module

    seen = []
    monkeypatch.setattr(llm_module, "huge_pages", lambda tensors: seen.append(list(tensors)) or 123)
    llm = LLM(tiny[1], threads=1)
    try:  # every weight of the model is offered
        assert llm.weights_in_huge_pages == 123 and len(seen) == 1
        assert {t.data_ptr() for t in seen[0]} == {b.tensor.data_ptr() for w in llm.model.weights.values()
                                                   for b in w.blobs.values()}
    finally:
        llm.close()
    monkeypatch.setenv("DTORCH_NO_HUGE_PAGES", "1")
    llm = LLM(tiny[1], threads=1)
    try:
        assert llm.weights_in_huge_pages == 0 and len(seen) == 1
    finally:
        llm.close()
    monkeypatch.setenv("DTORCH_NO_HUGE_PAGES", "sometimes")
    with pytest.raises(dtorch.DtorchError, match="DTORCH_NO_HUGE_PAGES"):
        LLM(tiny[1], threads=1)


@pytest.mark.skipif(not hasattr(mmap, "MADV_DONTNEED") or not os.path.exists("/proc/self/smaps"),
                    reason="no madvise(MADV_DONTNEED) or /proc/self/smaps on this platform")
def test_a_tensor_read_leaves_no_pages_of_the_file_map_behind(tmp_path):
    from dtorch.models.loaders.gguf import _open, _release

    _write(tmp_path / "m.gguf", ["a", "b"])
    reader = _open(tmp_path / "m.gguf")
    (t,) = reader.tensors
    copy = np.array(t.data, copy=True)  # what a read makes
    where = t.data.ctypes.data
    assert _mapped_kib(where) >= t.n_bytes // 1024  # read: every page of the tensor mapped here
    _release(reader, [t])
    assert _mapped_kib(where) < 64  # the header's pages at most
    assert np.array_equal(t.data, copy)  # the map reads the file again where it is touched


def test_building_and_running_a_model_graph_never_imports_sympy(tiny):
    """Torch's meta ``empty_like`` imports its symbolic-shapes module and sympy (33 MiB of RSS); the graph's shape
    inference makes contiguous outputs without it. Run in a fresh process: this one may have sympy already."""
    import subprocess
    import sys

    code = ("import sys, dtorch\nfrom dtorch.engine.llm import LLM\nfrom dtorch.engine.sampling import SamplingParams\n"
            f"llm = LLM({tiny[1]!r}, threads=1)\n"
            "out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3))[0].outputs[0].token_ids\n"
            "print(len(out), 'sympy' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["3", "False"]


def test_meta_inference_keeps_strides_where_the_op_asks_for_them():
    """The graph's ``empty_like`` shortcut serves contiguous tensors only: a transposed meta input still gets torch's
    own ``empty_like``, strides and all."""
    from dtorch.graph.infer import _MetaEmptyLike

    x = torch.empty(4, 6, device="meta").t()
    with _MetaEmptyLike():
        same, contig, half = torch.empty_like(x), torch.empty_like(x, memory_format=torch.contiguous_format), \
            torch.empty_like(torch.empty(3, 5, device="meta"), dtype=torch.float16)
    assert same.stride() == torch.empty_like(x).stride() == (1, 6)
    assert contig.shape == (6, 4) and contig.stride() == (4, 1)
    assert half.shape == (3, 5) and half.dtype == torch.float16 and half.device.type == "meta"


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")
def test_a_large_buffer_freed_after_loading_leaves_the_process(tiny):
    """After ``LLM(...)`` (which pins glibc's mmap threshold), a freed 8 MiB buffer is unmapped, not kept in the
    heap: RSS falls back by about its size. (Where the C library is not glibc, the pin does nothing: skipped.)
    Run in a fresh process: after the rest of the suite this one's heap may hold free chunks large enough to serve
    the buffer from pages already resident, whatever the threshold."""
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's mallopt")
    code = ("import torch\nfrom dtorch.engine.llm import LLM\n"
            f"LLM({tiny[1]!r}, threads=1)\n"
            "def rss_kib():\n"
            "    with open('/proc/self/status') as f:\n"
            "        return next(int(line.split()[1]) for line in f if line.startswith('VmRSS:'))\n"
            "drops = []\n"
            # a freed mapped buffer would otherwise raise the threshold: the next one would come from the heap
            "for _ in range(3):\n"
            "    buf = torch.ones(8 << 20, dtype=torch.uint8)\n"
            "    held = rss_kib()\n"
            "    del buf\n"
            "    drops.append(held - rss_kib())\n"
            "print(*drops)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    drops = [int(d) for d in res.stdout.split()]
    assert len(drops) == 3 and all(d > 6 * 1024 for d in drops), drops
