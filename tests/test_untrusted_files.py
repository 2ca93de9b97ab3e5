"""Untrusted model files: non-regular files, shard paths outside the directory, GGUF offsets and alignment,
config field types and ranges, the memory a config implies, non-finite weights, and fuzzed GGUF / safetensors
readers. Every outcome is a load or a DtorchError naming the file and the field or tensor."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import load_file, save_file

from dtorch import DtorchError, ModelError
from dtorch.models import ModelConfig, load_checkpoint, open_checkpoint
from dtorch.models.loaders import checkpoint as checkpoint_mod

V = gguf.GGUFValueType
# a tiny Llama: vocab 32, hidden 16, 1 layer, 2 heads of 8, 1 kv head, ffn 32
_CFG = dict(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def _hf_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    c = ModelConfig.from_hf(_CFG)
    return {n: torch.randn(s, generator=g) * 0.1 for n, s in checkpoint_mod.expected_shapes(c).items()}


def _hf_dir(path, config: dict | None = None, tensors: dict | None = None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or _CFG))
    save_file(tensors or _hf_tensors(), str(path / "model.safetensors"))
    return path


_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def _gguf_meta(**override) -> dict:
    meta = {"llama.vocab_size": (32, V.UINT32), "llama.embedding_length": (16, V.UINT32),
            "llama.feed_forward_length": (32, V.UINT32), "llama.block_count": (1, V.UINT32),
            "llama.attention.head_count": (2, V.UINT32), "llama.attention.head_count_kv": (1, V.UINT32),
            "llama.attention.layer_norm_rms_epsilon": (1e-6, V.FLOAT32), "llama.context_length": (64, V.UINT32),
            "tokenizer.ggml.eos_token_id": (2, V.UINT32)}
    return meta | override


def _write_gguf(path, meta: dict | None = None, tensors: dict | None = None, qtype=Q.F32):
    w = gguf.GGUFWriter(str(path), "llama")
    for k, (v, t) in (meta if meta is not None else _gguf_meta()).items():
        w.add_key_value(k, v, t)
    for name, t in (tensors or _hf_tensors()).items():
        if name in _GLOBAL:
            g = _GLOBAL[name]
        else:
            _, _, i, rest = name.split(".", 3)
            base, kind = rest.rsplit(".", 1)
            g = f"blk.{i}.{_GGUF_NAMES[base]}.{kind}"
        a = t.numpy().astype(np.float32)
        w.add_tensor(g, gguf.quants.quantize(a, qtype) if qtype != Q.F32 else a, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_seed_files_load(tmp_path):
    assert load_checkpoint(_hf_dir(tmp_path / "hf")).config.num_layers == 1
    assert load_checkpoint(_write_gguf(tmp_path / "m.gguf")).config.vocab_size == 32


# --- 1. regular files only -----------------------------------------------------------------------------------

def _load_in_subprocess(path, timeout: float = 60) -> subprocess.CompletedProcess:
    """load_checkpoint(path) in a child bounded by ``timeout`` (a FIFO that hangs the open fails the test, not CI)."""
    code = textwrap.dedent(f"""
        from dtorch import ModelError
        from dtorch.models import load_checkpoint
        try:
            load_checkpoint({str(path)!r})
        except ModelError as e:
            print("ModelError:", e)
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_fifo_in_model_directory_is_refused(tmp_path, name):
    d = _hf_dir(tmp_path / "m")
    (d / name).unlink(missing_ok=True)
    os.mkfifo(d / name)
    out = _load_in_subprocess(d)
    assert f"{name}: is a FIFO (named pipe), not a regular file" in out.stdout, out.stdout + out.stderr


def test_fifo_gguf_and_shard_are_refused(tmp_path):
    os.mkfifo(tmp_path / "m.gguf")
    with pytest.raises(ModelError, match=r"m.gguf: is a FIFO \(named pipe\), not a regular file"):
        load_checkpoint(tmp_path / "m.gguf")
    with pytest.raises(ModelError, match="no config.json and no .gguf file"):
        load_checkpoint(tmp_path)  # a directory holding it: find_model does not take the FIFO for its .gguf
    d = _hf_dir(tmp_path / "sharded")
    (d / "model.safetensors").rename(d / "a.safetensors")
    os.mkfifo(d / "b.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "a.safetensors",
                                                                               "y": "b.safetensors"}}))
    with pytest.raises(ModelError, match=r"b.safetensors: is a FIFO .* expected a weights shard"):
        load_checkpoint(d)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"])
def test_directory_or_device_instead_of_file(tmp_path, name):
    d = _hf_dir(tmp_path / "m")
    (d / name).unlink(missing_ok=True)
    (d / name).mkdir()
    with pytest.raises(ModelError, match=f"{name}: is a directory, not a regular file"):
        load_checkpoint(d)
    (d / name).rmdir()
    (d / name).symlink_to("/dev/zero")
    with pytest.raises(ModelError, match=f"{name}: is a character device, not a regular file"):
        load_checkpoint(d)
    with pytest.raises(ModelError, match="zero: is a character device"):
        load_checkpoint("/dev/zero")


# --- 2. shard paths stay inside the model directory ------------------------------------------------------------

@pytest.mark.parametrize("index", ["model.safetensors.index.json", "pytorch_model.bin.index.json"])
@pytest.mark.parametrize("shard", ["../other/model.safetensors", "/dev/zero", "sub/../../x.safetensors",
                                   "C:\\weights.bin", 7])
def test_shard_path_outside_directory(tmp_path, index, shard):
    other = _hf_dir(tmp_path / "other")
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_CFG))
    weight_map = {n: shard for n in load_file(str(other / "model.safetensors"))}
    (d / index).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelError, match=rf"{index}: weight_map names .* expected a .*file name inside"):
        load_checkpoint(d)


# --- 3. tensor offsets, alignment and overlap -------------------------------------------------------------------

def _tensor_offset_fields(path) -> tuple[bytearray, list[int], int]:
    """The file's bytes, the byte positions of each tensor's uint64 offset field (in file order), the data start."""
    r = gguf.GGUFReader(str(path))
    fields = [t.field.offset + sum(p.nbytes for p in t.field.parts[:-1]) for t in r.tensors]
    return bytearray(path.read_bytes()), fields, int(r.data_offset)


def test_gguf_misaligned_tensor(tmp_path):
    path = _write_gguf(tmp_path / "m.gguf")
    data, fields, _ = _tensor_offset_fields(path)
    (off,) = struct.unpack_from("<Q", data, fields[1])
    struct.pack_into("<Q", data, fields[1], off + 4)
    (tmp_path / "bad.gguf").write_bytes(data)
    with pytest.raises(ModelError, match=r"bad.gguf: tensor '.*' starts at byte \d+ of the data section; expected a "
                                         r"multiple of general.alignment = 32"):
        load_checkpoint(tmp_path / "bad.gguf")


def test_gguf_overlapping_tensors(tmp_path):
    path = _write_gguf(tmp_path / "m.gguf")
    data, fields, _ = _tensor_offset_fields(path)
    (off0,) = struct.unpack_from("<Q", data, fields[0])
    struct.pack_into("<Q", data, fields[1], off0)  # the second tensor reads the first's bytes
    (tmp_path / "bad.gguf").write_bytes(data)
    with pytest.raises(ModelError, match=r"bad.gguf: tensors '.*' and '.*' overlap"):
        load_checkpoint(tmp_path / "bad.gguf")


def test_gguf_offset_past_the_end(tmp_path):
    path = _write_gguf(tmp_path / "m.gguf")
    data, fields, _ = _tensor_offset_fields(path)
    struct.pack_into("<Q", data, fields[-1], 1 << 40)
    (tmp_path / "bad.gguf").write_bytes(data)
    with pytest.raises(ModelError, match=r"bad.gguf: (truncated: tensor|not a readable GGUF)"):
        load_checkpoint(tmp_path / "bad.gguf")


def test_safetensors_bad_header_names_file(tmp_path):
    d = _hf_dir(tmp_path / "m")
    raw = bytearray((d / "model.safetensors").read_bytes())
    struct.pack_into("<Q", raw, 0, 1 << 62)  # a header "size" of 4 EiB
    (d / "model.safetensors").write_bytes(raw)
    with pytest.raises(ModelError, match=r"model.safetensors: not a readable safetensors file"):
        load_checkpoint(d)
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 40]}}).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(ModelError, match=r"model.safetensors: not a readable safetensors file"):
        load_checkpoint(d)


# --- 4. config fields: type and range, named as the file spells them ------------------------------------------

@pytest.mark.parametrize(("key", "value", "match"), [
    ("num_attention_heads", "8", r"num_attention_heads must be an int in \[1, 4096\], got '8' \(str\)"),
    ("num_attention_heads", None, r"num_attention_heads must be an int in \[1, 4096\], got None"),
    ("rope_scaling", [1, 2], r"rope_scaling must be an object .*got \[1, 2\] \(list\)"),
    ("eos_token_id", 2.0, r"eos_token_id must be a token id .*got 2.0 \(float\)"),
    ("vocab_size", 0, r"vocab_size must be an int in \[1, 4194304\], got 0"),
    ("num_hidden_layers", 10**9, r"num_hidden_layers must be an int in \[1, 4096\], got 1000000000"),
    ("max_position_embeddings", 2**26, r"max_position_embeddings must be an int in \[1, 16777216\], got 67108864"),
    ("max_position_embeddings", 10**10, r"max_position_embeddings must be an int in \[1, 16777216\]"),
    ("rms_norm_eps", float("nan"), r"rms_norm_eps must be a positive finite number"),
    ("tie_word_embeddings", "yes", r"tie_word_embeddings must be true or false"),
])
def test_config_json_field_checked(tmp_path, key, value, match):
    d = _hf_dir(tmp_path / "m", config=_CFG | {key: value})
    with pytest.raises(ModelError, match=rf"config.json: {match}"):
        load_checkpoint(d)


def test_config_json_nesting_bomb(tmp_path):
    d = _hf_dir(tmp_path / "m")
    (d / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ModelError, match=r"config.json: (its JSON is nested too deeply|cannot read JSON)"):
        load_checkpoint(d)


def test_config_json_cross_field_names_file(tmp_path):
    d = _hf_dir(tmp_path / "m", config=_CFG | {"num_key_value_heads": 3})
    with pytest.raises(ModelError, match=r"config.json: ModelConfig: num_heads \(2\) must be a multiple"):
        load_checkpoint(d)


@pytest.mark.parametrize(("key", "value", "match"), [
    ("llama.block_count", (10**9, V.UINT32), r"llama.block_count must be an int in \[1, 4096\], got 1000000000"),
    ("llama.vocab_size", (0, V.UINT32), r"llama.vocab_size must be an int in \[1, 4194304\], got 0"),
    ("llama.attention.head_count", ("two", V.STRING), r"llama.attention.head_count must be an int .*got 'two'"),
    ("llama.context_length", (2**26, V.UINT64), r"llama.context_length must be an int in \[1, 16777216\]"),
    ("llama.attention.layer_norm_rms_epsilon", (-1.0, V.FLOAT32),
     r"llama.attention.layer_norm_rms_epsilon must be a positive"),
    ("tokenizer.ggml.eos_token_id", (2.5, V.FLOAT32), r"tokenizer.ggml.eos_token_id must be an int >= 0"),
])
def test_gguf_metadata_checked(tmp_path, key, value, match):
    path = _write_gguf(tmp_path / "m.gguf", _gguf_meta(**{key: value}))
    with pytest.raises(ModelError, match=rf"m.gguf: {match}"):
        load_checkpoint(path)


# --- 5. the memory a config implies -------------------------------------------------------------------------

def test_memory_estimate_refused_before_allocating(tmp_path, monkeypatch):
    d = _hf_dir(tmp_path / "m")
    monkeypatch.setattr(checkpoint_mod, "available_memory", lambda: 1000)
    with pytest.raises(ModelError, match=r"m: this model needs about 0.00 GiB of memory .* most of it comes from "
                                         r"num_hidden_layers = 1"):
        open_checkpoint(d)
    path = _write_gguf(tmp_path / "m.gguf", _gguf_meta(**{"llama.context_length": (1 << 20, V.UINT32)}))
    monkeypatch.setattr(checkpoint_mod, "available_memory", lambda: 1 << 24)  # 16 MiB; the table takes 32
    with pytest.raises(ModelError, match=r"RoPE table 0.03 GiB.*most of it comes from llama.context_length = 1048576"):
        open_checkpoint(path)


def test_memory_estimate_counts_packed_bytes():
    c = ModelConfig.from_hf(_CFG)
    shapes = checkpoint_mod.expected_shapes(c)
    full = checkpoint_mod.memory_estimate(c, shapes, torch.float32, {})
    packed = checkpoint_mod.memory_estimate(c, shapes, torch.float32, {"model.embed_tokens.weight": 10})
    assert full["vocab_size"] - packed["vocab_size"] == 32 * 16 * 4 - 10
    assert full["max_position_embeddings"] == 64 * 4 * 2 * 4


# --- 6. non-finite weights ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_non_finite_weights_refused(tmp_path, fmt):
    nan = _hf_tensors()
    nan["model.layers.0.mlp.up_proj.weight"].fill_(float("nan"))
    inf = _hf_tensors()
    inf["model.embed_tokens.weight"][5] = float("inf")
    for tag, tensors, name in (("nan", nan, "model.layers.0.mlp.up_proj.weight"),
                               ("inf", inf, "model.embed_tokens.weight")):
        path = _hf_dir(tmp_path / tag, tensors=tensors) if fmt == "hf" else _write_gguf(tmp_path / f"{tag}.gguf",
                                                                                         tensors=tensors)
        with pytest.raises(ModelError, match=rf"{tag}(.gguf)?: tensor '{name}' .* holds non-finite values"):
            load_checkpoint(path)
        ck = load_checkpoint(path, check_finite=False)  # skippable
        assert not torch.isfinite(ck.tensors[name]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite_is_torch_isfinite_all(dtype):
    """The load's check (one ``aminmax`` pass) says what ``torch.isfinite(t).all()`` says: one NaN, inf or -inf
    anywhere among 3M values, the dtype's largest finite values, an empty tensor."""
    from dtorch.models.loaders.checkpoint import all_finite

    g = torch.Generator().manual_seed(0)
    t = torch.randn(1500, 2000, generator=g).to(dtype)
    cases = [t, t[:, :0]]
    for where, bad in ((0, float("nan")), (1_234_567, float("inf")), (2_999_999, float("-inf"))):
        u = t.clone()
        u.view(-1)[where] = bad
        cases.append(u)
    big = torch.zeros(7, dtype=dtype)
    big[2], big[5] = torch.finfo(dtype).max, torch.finfo(dtype).min
    cases.append(big)
    assert [all_finite(c) for c in cases] == [bool(torch.isfinite(c).all()) for c in cases] == \
        [True, True, False, False, False, True]


def test_non_finite_packed_scale_refused(tmp_path):
    cfg = _CFG | {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2}
    tensors = {n: torch.randn(s) for n, s in checkpoint_mod.expected_shapes(ModelConfig.from_hf(cfg)).items()}
    meta = _gguf_meta(**{"llama.embedding_length": (32, V.UINT32), "llama.attention.head_count": (4, V.UINT32),
                         "llama.attention.head_count_kv": (2, V.UINT32)})
    path = _write_gguf(tmp_path / "q.gguf", meta, tensors, qtype=Q.Q8_0)
    r = gguf.GGUFReader(str(path))
    t = next(t for t in r.tensors if t.name == "blk.0.ffn_up.weight")
    raw = bytearray(path.read_bytes())
    raw[int(t.data_offset):int(t.data_offset) + 2] = np.array([np.inf], np.float16).tobytes()  # block 0's d
    (tmp_path / "bad.gguf").write_bytes(raw)
    with open_checkpoint(tmp_path / "bad.gguf") as ck:
        with pytest.raises(ModelError, match=r"bad.gguf: tensor 'model.layers.0.mlp.up_proj.weight' holds a "
                                             r"non-finite \(NaN or inf\) block scale"):
            ck.get_packed("model.layers.0.mlp.up_proj.weight")
        assert ck.get_packed("model.layers.0.mlp.gate_proj.weight")[0] == "gguf.q8_0"


# --- 7. fuzzing: a load or a DtorchError, never a hang, a crash or a huge allocation ----------------------------

_FUZZ = settings(max_examples=40, deadline=2000, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    d = tmp_path_factory.mktemp("seeds")
    _hf_dir(d / "hf")
    _write_gguf(d / "m.gguf")
    return d, (d / "m.gguf").read_bytes(), (d / "hf" / "model.safetensors").read_bytes()


def _load_or_dtorch_error(path) -> None:
    try:
        with open_checkpoint(path) as ck:
            for name in ck.shapes:
                ck.get(name)
    except DtorchError:
        pass


def _mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    raw = bytearray(data if cut is None else data[:cut])
    for pos, byte in edits:
        if raw:
            raw[pos % len(raw)] = byte
    return bytes(raw)


_EDITS = st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=8)


@_FUZZ
@given(edits=_EDITS, cut=st.none() | st.integers(0, 4096), header_only=st.booleans())
def test_fuzz_gguf_bytes(seeds, tmp_path_factory, edits, cut, header_only):
    d, gguf_bytes, _ = seeds
    if header_only:  # aim the edits at the header, metadata and tensor infos
        edits = [(p % 700, b) for p, b in edits]
    path = tmp_path_factory.mktemp("g") / "f.gguf"
    path.write_bytes(_mutate(gguf_bytes, edits, cut))
    _load_or_dtorch_error(path)


_META_VALUES = st.one_of(
    st.integers(-2**63, 2**64 - 1).map(lambda v: (v, V.INT64 if v < 0 else V.UINT64)),
    st.floats(allow_nan=True).map(lambda v: (v, V.FLOAT64)),
    st.text(max_size=8).map(lambda v: (v, V.STRING)),
    st.booleans().map(lambda v: (v, V.BOOL)),
    st.lists(st.integers(0, 100), max_size=4).map(lambda v: (v, V.ARRAY)),
)


@_FUZZ
@given(key=st.sampled_from(sorted(_gguf_meta()) + ["general.alignment", "llama.rope.freq_base",
                                                   "tokenizer.ggml.bos_token_id", "llama.attention.key_length"]),
       value=_META_VALUES)
def test_fuzz_gguf_metadata(tmp_path_factory, key, value):
    path = tmp_path_factory.mktemp("g") / "f.gguf"
    try:
        _write_gguf(path, _gguf_meta(**{key: value}))
    except (ValueError, TypeError, OverflowError, struct.error):  # the writer refuses it: nothing to read
        return
    _load_or_dtorch_error(path)


@_FUZZ
@given(edits=_EDITS, cut=st.none() | st.integers(0, 4096), header_only=st.booleans())
def test_fuzz_safetensors_bytes(seeds, tmp_path_factory, edits, cut, header_only):
    d, _, st_bytes = seeds
    if header_only:
        edits = [(p % (8 + int.from_bytes(st_bytes[:8], "little")), b) for p, b in edits]
    m = tmp_path_factory.mktemp("s")
    (m / "config.json").write_bytes((d / "hf" / "config.json").read_bytes())
    (m / "model.safetensors").write_bytes(_mutate(st_bytes, edits, cut))
    _load_or_dtorch_error(m)


@_FUZZ
@given(key=st.sampled_from(sorted(_CFG) + ["head_dim", "rope_scaling", "rope_theta", "rope_parameters"]),
       value=st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=6),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                       max_size=3), max_leaves=6))
def test_fuzz_config_json(seeds, tmp_path_factory, key, value):
    d, _, st_bytes = seeds
    m = tmp_path_factory.mktemp("c")
    (m / "config.json").write_text(json.dumps(_CFG | {key: value}))
    (m / "model.safetensors").write_bytes(st_bytes)
    _load_or_dtorch_error(m)
