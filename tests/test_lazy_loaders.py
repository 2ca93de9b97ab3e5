"""``open_checkpoint``: names and shapes checked without reading data; ``get(name, dim, runs)`` reads only the
slices asked for and equals the whole tensor sliced (GGUF: quantized rows and whole blocks of columns, Llama q/k
un-permuted per head; safetensors: slices of the file map), in memory of its own."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from dtorch import ModelError
from dtorch.models import default_model_path, load_checkpoint, open_checkpoint
from dtorch.models.loaders import expected_shapes
from tests.tiny_models import save_random, tiny_config

transformers = pytest.importorskip("transformers")


def _owns_its_memory(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _check_slices(lazy, full: dict[str, torch.Tensor], cases) -> None:
    for name, dim, runs in cases:
        got = lazy.get(name, dim, runs)
        want = full[name] if dim is None else torch.cat([full[name].narrow(dim, a, n) for a, n in runs], dim)
        assert got.dtype == lazy.dtype and _owns_its_memory(got), (name, dim, runs)
        torch.testing.assert_close(got, want.to(lazy.dtype), rtol=0, atol=0, msg=f"{name} {dim} {runs}")


def _config(**sizes):
    return tiny_config(transformers, "llama", vocab_size=96, hidden_size=32, intermediate_size=48,
                       max_position_embeddings=64, **sizes)


@pytest.fixture(scope="module")
def default_full():
    return load_checkpoint(default_model_path()).tensors


def test_gguf_slices_equal_the_whole_tensor_sliced(default_full):
    # default model: q [576, 576] 9 heads of 64 (Q4_1, blocks of 32), k [192, 576], embed Q8_0 [49152, 576]
    a = "model.layers.3.self_attn."
    cases = [
        (a + "q_proj.weight", 0, [(192, 192)]),  # one KV group of 3 query heads, un-permuted per head
        (a + "q_proj.weight", 0, [(0, 64), (320, 128)]),  # several runs of whole heads
        (a + "q_proj.weight", 0, [(10, 50)]),  # not whole heads: read whole, un-permuted, then sliced
        (a + "k_proj.weight", 0, [(64, 64)]),
        (a + "v_proj.weight", 0, [(128, 64)]),
        (a + "o_proj.weight", 1, [(384, 192)]),  # whole blocks of columns
        (a + "o_proj.weight", 1, [(5, 37)]),  # not whole blocks: read whole, then sliced
        ("model.layers.3.mlp.down_proj.weight", 1, [(0, 512), (1024, 512)]),
        ("model.embed_tokens.weight", 0, [(16384, 16384)]),
        ("model.layers.3.input_layernorm.weight", None, []),
        (a + "q_proj.weight", None, []),
    ]
    with open_checkpoint(default_model_path()) as lazy:
        assert lazy.shapes == expected_shapes(lazy.config)
        _check_slices(lazy, default_full, cases)
        lazy.dtype = torch.bfloat16  # the cast follows the dtype asked for
        _check_slices(lazy, default_full, cases[:2])


@pytest.mark.parametrize("shard", [False, True])
def test_safetensors_slices_equal_the_whole_tensor_sliced(tmp_path, shard):
    save_random(transformers, _config(num_hidden_layers=2), tmp_path, max_shard_size="20KB" if shard else "1GB")
    full = load_checkpoint(tmp_path).tensors
    cases = [("model.layers.1.self_attn.q_proj.weight", 0, [(8, 16)]),
             ("model.layers.1.self_attn.o_proj.weight", 1, [(0, 8), (16, 8)]),
             ("model.layers.0.mlp.down_proj.weight", 1, [(24, 24)]),
             ("model.embed_tokens.weight", 0, [(48, 48)]),
             ("model.norm.weight", None, [])]
    with open_checkpoint(tmp_path, torch.bfloat16) as lazy:
        _check_slices(lazy, full, cases)
    with open_checkpoint(tmp_path) as lazy:
        _check_slices(lazy, full, cases)
        # a fresh tensor each time, never a view of the file's map
        x = lazy.get("model.norm.weight")
        x.add_(1.0)
        assert torch.equal(lazy.get("model.norm.weight"), full["model.norm.weight"])


def test_shapes_are_checked_when_opened_and_bad_reads_are_errors(tmp_path):
    save_random(transformers, _config(num_hidden_layers=1), tmp_path)
    lazy = open_checkpoint(tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"
    with pytest.raises(ModelError, match="no tensor 'model.layers.5.mlp.up_proj.weight'"):
        lazy.get("model.layers.5.mlp.up_proj.weight")
    with pytest.raises(ModelError, match=r"rows \[8, 24\) of dim 0 are outside tensor .*k_proj.weight' \[16, 32\]"):
        lazy.get(name, 0, [(8, 16)])
    with pytest.raises(ModelError, match="has no dim 2"):
        lazy.get(name, 2, [(0, 1)])
    lazy.close()
    with pytest.raises(ModelError, match="the checkpoint is closed"):
        lazy.get(name)

    tensors = load_file(tmp_path / "model.safetensors")
    tensors[name] = torch.zeros(8, 32)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape \[8, 32\]"):
        open_checkpoint(tmp_path)
