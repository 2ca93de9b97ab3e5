"""GGUF files (llama.cpp): metadata -> ModelConfig, tensors dequantized with the ``gguf`` package -> HF names.

Architectures: llama, qwen2, qwen3, gemma3 (norms stored with Gemma's 1 added), phi3 (``attn_qkv`` and ``ffn_up``
holding the fused q/k/v and gate/up) and qwen3moe (family ``qwen3_moe``: the router ``ffn_gate_inp`` and the stacked
experts ``ffn_{gate,up,down}_exps`` of each sparse layer, as ``convert_hf_to_gguf.py`` writes them), and the hybrid
qwen3next (``qwen3_next``) and qwen35 (``qwen3_5_text``): their gated delta net tensors ``ssm_*`` / ``attn_qkv`` /
``attn_gate`` are served as transformers holds them, undoing the converter's changes (see ``gguf_hybrid.hybrid_views``).
"""

from __future__ import annotations

import functools
import mmap
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dtorch.core.errors import ModelError
from dtorch.models.config import HYBRID_FAMILIES, ModelConfig
from dtorch.models.config_fields import check_field, check_fields, gguf_keys
from dtorch.models.loaders.checkpoint import Checkpoint, LazyCheckpoint, Reader, narrow_runs, used_shapes
from dtorch.models.loaders.files import regular_file
from dtorch.models.loaders.gguf_hybrid import View, gguf_shape, hybrid_fields, hybrid_views

# llama.cpp tensor name -> Hugging Face name; "{i}" is the layer index
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # Qwen3-MoE's router [E, H]
    # the hybrids (qwen3next, qwen35); attn_qkv / attn_gate are Qwen3.5's in_proj_qkv / in_proj_z (Qwen3-Next's
    # in_proj_qkvz is split into them by the converter: ``_hybrid_views`` joins them back)
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # [1, H]
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",  # [C, W]; transformers' Conv1d has [C, 1, W]
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
# parameters without a ``.weight``: ssm_a holds -exp(A_log), ssm_dt.bias is dt_bias renamed
_PARAM_NAMES = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}
# llama.cpp's stacked experts [E, I, H] / [E, H, I] -> the loaders' stacked names (no ``.weight``: see expected_shapes)
_EXPERT_NAMES = {
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# where an architecture's converter names a tensor otherwise: arch -> {llama.cpp name: HF name}
_ARCH_NAMES = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # fused as transformers has them
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
               "post_attention_norm": "post_attention_layernorm"},
}
# general.architecture -> ModelConfig family
_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "qwen3next": "qwen3_next",
             "qwen35": "qwen3_5_text", "gemma3": "gemma3", "phi3": "phi3"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_PARAM_RE = re.compile(r"^blk\.(\d+)\.(ssm_a|ssm_dt\.bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")

# quantization types this loader promises (the gguf package dequantizes more; those are let through too)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")


def hf_name(gguf_name: str, arch: str | None = None) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name (of a file of architecture ``arch``), or None for tensors the
    model does not use."""
    m = _PARAM_RE.match(gguf_name)
    if m:
        return f"model.layers.{m.group(1)}.{_PARAM_NAMES[m.group(2)]}"
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _EXPERT_NAMES:
        return f"model.layers.{m.group(1)}.{_EXPERT_NAMES[m.group(2)]}" if m.group(3) == "weight" else None
    if m:
        base = _ARCH_NAMES.get(arch, {}).get(m.group(2)) or _LAYER_NAMES.get(m.group(2))
        return None if base is None else f"model.layers.{m.group(1)}.{base}.{m.group(3)}"
    m = _GLOBAL_RE.match(gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


_DENSE_GGUF_NAMES = {hf: g for g, hf in reversed(_LAYER_NAMES.items())}  # the first wins: ffn_norm, not the hybrids'
_GLOBAL_GGUF_NAMES = {hf: g for g, hf in _GLOBAL_NAMES.items()}


def gguf_name(name: str, arch: str | None = None) -> str | None:
    """The llama.cpp name of a dense model's Hugging Face tensor name (``hf_name`` inverted, for a file of
    architecture ``arch``), or None if it has none."""
    m = re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$", name)
    if m:
        own = {hf: g for g, hf in _ARCH_NAMES.get(arch, {}).items()}
        base = own.get(m.group(2)) or _DENSE_GGUF_NAMES.get(m.group(2))
        return None if base is None else f"blk.{m.group(1)}.{base}.{m.group(3)}"
    m = re.match(r"^(.+)\.(weight|bias)$", name)
    base = _GLOBAL_GGUF_NAMES.get(m.group(1)) if m else None
    return None if base is None else f"{base}.{m.group(2)}"


def permute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's q/k row permutation (its converter's ``LlamaModel.permute``), which ``unpermute_qk`` undoes."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation for interleaved RoPE.

    llama.cpp's converter reorders each head's rows from the "rotate half" order (i, i + D/2) to adjacent
    pairs (2i, 2i+1); this puts them back. w: [n_heads * D, ...] (a weight or a bias).
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _open(path: Path) -> Any:
    try:
        import gguf  # only here: ops, graphs and Hugging Face checkpoints run without it
    except ImportError as e:
        raise ModelError(f"{path}: reading a GGUF file needs the gguf package ({e}); pip install gguf") from None
    try:
        return _lean_reader(gguf.GGUFReader)(str(path))
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors ... on a bad file
        raise ModelError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); expected a complete GGUF "
                         "v2/v3 file as written by llama.cpp") from None


@functools.cache
def _lean_reader(base: type) -> type:
    """gguf's ``GGUFReader`` with its metadata parsed into plain ndarray views of the file map. Its own views are
    ``np.memmap`` s, each with a dict of attributes: one per string of the vocabulary and merges made a 49k-token
    file cost 160 MB of RSS (3x its weights) and 4x the time to open."""
    class LeanGGUFReader(base):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None) -> np.ndarray:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))

    return LeanGGUFReader


def _release(reader: Any, tensors: Any) -> None:
    """Drop this process's pages of the file map under ``tensors``' bytes (MADV_DONTNEED; the page cache keeps them,
    so a later read costs a minor fault): their weights are copied out, and the map would count in RSS beside them."""
    mm = getattr(reader.data, "_mmap", None)
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if mm is None or advice is None or not hasattr(mm, "madvise"):
        return
    for t in tensors:
        lo, hi = int(t.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE, int(t.data_offset) + int(t.n_bytes)
        if hi > lo:
            mm.madvise(advice, lo, hi - lo)


def read_metadata(reader: Any, path: Path) -> dict[str, Any]:
    """Every metadata key of the file with its Python value (arrays as lists)."""
    meta: dict[str, Any] = {}
    for key, f in reader.fields.items():
        try:
            meta[key] = f.contents()
        except Exception as e:
            raise ModelError(f"{path}: metadata key {key!r} is unreadable ({e})") from None
    return meta


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str], path: Path,
                     rope_freqs: torch.Tensor | None = None) -> ModelConfig:
    """A ModelConfig from ``{arch}.*`` metadata keys; tied embeddings when there is no ``output.weight``.

    ``rope_freqs``: llama.cpp's per-frequency RoPE divisors ([head_dim / 2], Llama 3 scaling), if the file has them.

    qwen3moe: ``expert_count``, ``expert_used_count`` and ``expert_feed_forward_length`` give the experts; a layer is
    sparse when the file has its router ``blk.N.ffn_gate_inp.weight`` (the others are ``mlp_only_layers``, dense
    MLPs of ``feed_forward_length``). llama.cpp always renormalizes Qwen3-MoE's top-k weights (its converter writes
    no ``norm_topk_prob``), so ``norm_topk_prob`` is true unless the file says ``{arch}.expert_weights_norm`` false.
    qwen3next adds ``expert_shared_feed_forward_length`` (the shared expert); the hybrids see
    ``gguf_hybrid.hybrid_fields``.
    """
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in _FAMILIES:
        raise ModelError(f"{path}: general.architecture {arch!r} is not supported; expected one of "
                         f"{', '.join(_FAMILIES)}")
    family = _FAMILIES[arch]

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise ModelError(f"{path}: metadata key {arch}.{key} is missing; a {arch} GGUF must have it")
        return meta[f"{arch}.{key}"]

    keys = gguf_keys(arch)
    check_fields(meta, keys, str(path))
    hidden, heads = need("embedding_length"), need("attention.head_count")
    if f"{arch}.vocab_size" in meta:
        vocab = meta[f"{arch}.vocab_size"]
    else:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if isinstance(tokens, list) else 0
        if not vocab:
            raise ModelError(f"{path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens gives the vocabulary size")
        check_field("vocab_size", vocab, f"{path}: the length of tokenizer.ggml.tokens")
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    layers = need("block_count")
    moe: dict[str, Any] = {}
    if family in ("qwen3_moe", "qwen3_next"):
        dense = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names)
        moe = dict(num_experts=need("expert_count"), num_experts_per_tok=need("expert_used_count"),
                   moe_intermediate_size=need("expert_feed_forward_length"),
                   norm_topk_prob=meta.get(f"{arch}.expert_weights_norm", True), decoder_sparse_step=1,
                   mlp_only_layers=dense)
        if family == "qwen3_next":
            moe["shared_expert_intermediate_size"] = need("expert_shared_feed_forward_length")
        # the dense layers' width; with every layer sparse it is unused (and feed_forward_length may be absent)
        ff = need("feed_forward_length") if dense \
            else meta.get(f"{arch}.feed_forward_length", moe["moe_intermediate_size"])
    else:
        ff = need("feed_forward_length")
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
    check_field("head_dim", head_dim, f"{path}: {arch}.embedding_length / {arch}.attention.head_count")
    hybrid = hybrid_fields(need, layers, head_dim, arch, path) if family in HYBRID_FAMILIES else {}
    if family in ("gemma3", "phi3"):
        hybrid = _window_fields(meta, family, arch, layers, hidden, heads, head_dim, tensor_names, path)
    elif family == "llama" and f"{arch}.attention.sliding_window" in meta:  # Mistral, converted to llama
        window = meta[f"{arch}.attention.sliding_window"]
        check_field("sliding_window", window, f"{path}: {arch}.attention.sliding_window")
        hybrid = dict(sliding_window=window, layer_types=("sliding_attention",) * layers)
    try:
        return ModelConfig(
            family=family, vocab_size=vocab, hidden_size=hidden, intermediate_size=ff,
            num_layers=layers, num_heads=heads,
            num_kv_heads=meta.get(f"{arch}.attention.head_count_kv", heads),
            head_dim=head_dim,
            rope_theta=meta.get(f"{arch}.rope.freq_base", 10000.0),
            rope_scaling=hybrid.pop("rope_scaling", None) if rope_freqs is None
            else {"rope_type": "factors", "factors": rope_freqs.tolist()},
            rms_norm_eps=need("attention.layer_norm_rms_epsilon"),
            max_position_embeddings=meta.get(f"{arch}.context_length", 2048),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias=family == "qwen2",
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3", *HYBRID_FAMILIES),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_ids=tuple(dict.fromkeys(eos)), **moe,
            **hybrid,
        )
    except ModelError as e:  # a key that passed alone but not with the others (head_count vs head_count_kv, ...)
        raise ModelError(f"{path}: {e} (from the {arch}.* metadata keys)") from None


def _window_fields(meta: dict[str, Any], family: str, arch: str, layers: int, hidden: int, heads: int, head_dim: int,
                   tensor_names: set[str], path: Path) -> dict[str, Any]:
    """The fields of a gemma3 or phi3 file beyond the common keys, read as llama.cpp reads them.

    Both: ``{arch}.attention.sliding_window``. phi3: every layer slides; ``rope.dimension_count`` rotated dims of each
    head; LongRoPE (``rope_factors_long``) is refused. gemma3: every sixth layer full attention, the others sliding
    (llama.cpp's pattern); the sliding layers' RoPE base ``rope.freq_base_swa`` (10000 when absent, as llama.cpp);
    linear RoPE scaling of the global layers from ``rope.scaling.type`` / ``rope.scaling.factor``; queries scaled by
    ``attention.scale`` when given, else by head_dim ** -0.5 (hidden / heads for the 62-layer 27B, llama.cpp's rule);
    the embedding scaled by sqrt(hidden), norms around each block, (1 + w) norms (stored with the 1 added), GeGLU.
    """
    window = meta.get(f"{arch}.attention.sliding_window")
    if window is not None:
        check_field("sliding_window", window, f"{path}: {arch}.attention.sliding_window")
    out: dict[str, Any] = {}
    if family == "phi3":
        if "rope_factors_long.weight" in tensor_names:
            raise ModelError(f"{path}: this phi3 file has LongRoPE factors (rope_factors_long.weight); LongRoPE "
                             "scaling is not supported")
        rot = meta.get(f"{arch}.rope.dimension_count", head_dim)
        if isinstance(rot, bool) or not isinstance(rot, int) or not 2 <= rot <= head_dim or rot % 2:
            raise ModelError(f"{path}: metadata key {arch}.rope.dimension_count is {rot!r}; expected an even number "
                             f"of rotated dims <= the head dim {head_dim}")
        out["partial_rotary_factor"] = rot / head_dim
        if window is not None:
            out |= dict(sliding_window=window, layer_types=("sliding_attention",) * layers)
        return out
    local = meta.get(f"{arch}.rope.freq_base_swa", 10000.0)
    check_field("rope_local_theta", local, f"{path}: {arch}.rope.freq_base_swa")
    scale = meta.get(f"{arch}.attention.scale")
    if scale is not None:
        check_field("query_pre_attn_scalar", scale, f"{path}: {arch}.attention.scale")
        scalar = scale ** -2.0
    else:
        scalar = hidden / heads if layers == 62 else head_dim
    types = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers))
    if window is None:
        types = ()
    out = dict(layer_types=types, sliding_window=window, rope_local_theta=local, query_pre_attn_scalar=scalar,
               embed_scale=True, sandwich_norm=True, norm_plus_one=True, hidden_act="gelu_tanh")
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        factor = meta.get(f"{arch}.rope.scaling.factor")
        if kind != "linear" or isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 0:
            raise ModelError(f"{path}: rope scaling {kind!r} with factor {factor!r} is not supported; expected "
                             "linear scaling with a positive factor")
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    return out


def dequantize(t: Any, path: Path) -> torch.Tensor:
    """One GGUF tensor as float32 torch, in torch's (row-major, reversed-GGUF) shape."""
    return _dequantize(t, t.data, tuple(int(s) for s in reversed(t.shape)), path)  # GGUF lists dims fastest first


def _dequantize(t: Any, data: np.ndarray, shape: tuple[int, ...], path: Path) -> torch.Tensor:
    """``data`` (all or some whole blocks of tensor ``t``'s raw rows) as float32 torch of ``shape``."""
    from gguf.quants import dequantize as gguf_dequantize

    try:
        arr = np.array(gguf_dequantize(data, t.tensor_type), dtype=np.float32, copy=True).reshape(shape)
    except NotImplementedError:
        raise ModelError(f"{path}: tensor {t.name!r} has quantization type {t.tensor_type.name}, which the gguf "
                         f"package cannot dequantize; supported: {', '.join(SUPPORTED_TYPES)}") from None
    except Exception as e:
        raise ModelError(f"{path}: tensor {t.name!r} ({t.tensor_type.name}, shape {list(shape)}) is unreadable "
                         f"({type(e).__name__}: {e}); the file may be truncated") from None
    return torch.from_numpy(arr)


def _read_runs(t: Any, dim: int | None, runs: list[tuple[int, int]], path: Path) -> torch.Tensor:
    """The runs ``runs`` of dim ``dim`` of GGUF tensor ``t`` (2-D, or 3-D stacked experts [E, rows, cols]) as
    float32, dequantizing only the blocks they cover: any dim but the last takes whole rows of blocks (dim 0 of
    stacked experts: only those experts' bytes), the last takes whole blocks when aligned (else the tensor is read
    whole)."""
    import gguf

    shape = tuple(int(s) for s in reversed(t.shape))
    data = t.data  # a map of the file: [..., rows, bytes (or items) of one row]; slicing it reads only those pages
    if dim is None or len(shape) not in (2, 3):
        return narrow_runs(_dequantize(t, data, shape, path), dim, runs)
    last = len(shape) - 1
    if dim < last:
        lead = (slice(None),) * dim
        parts = [_dequantize(t, data[(*lead, slice(a, a + n))], (*shape[:dim], n, *shape[dim + 1:]), path)
                 for a, n in runs]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)
    block = gguf.GGML_QUANT_SIZES[t.tensor_type][0] if t.tensor_type in gguf.GGML_QUANT_SIZES else 0
    per_block = data.shape[-1] * block // shape[-1] if block else 0  # items of ``data`` per block of a row
    if not block or any(a % block or n % block for a, n in runs):
        return narrow_runs(_dequantize(t, data, shape, path), dim, runs)
    parts = [_dequantize(t, data[..., a // block * per_block:(a + n) // block * per_block], (*shape[:-1], n), path)
             for a, n in runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _read_view(v: View, dim: int | None, runs: list[tuple[int, int]], path: Path) -> torch.Tensor:
    """``_read_runs`` of a view; columns of a 2-D view whose columns stay in place are read alone, anything else
    whole (these are the hybrids' small or per-layer tensors)."""
    cols_only = dim == 1 and len(v.shape) == 2 and v.cols is None
    parts = [_read_runs(t, 1, runs, path) if cols_only else dequantize(t, path) for t in v.parts]
    x = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
    if v.rows is not None:
        x = x[v.rows]
    if v.cols is not None:
        x = x[:, v.cols]
    if v.value is not None:
        x = v.value(x)
    return x if cols_only else narrow_runs(x.reshape(v.shape), dim, runs)


def stored_layout(ggml_type: Any, dtype: torch.dtype) -> str | None:
    """The layout a tensor of GGUF type ``ggml_type`` keeps in a model computing in ``dtype``: its block format's
    ("gguf.q4_1"), "f16" / "bf16" for 16-bit floats of another dtype than ``dtype``, else None (read as ``dtype``)."""
    from dtorch.kernels.half import HALF_LAYOUTS
    from dtorch.kernels.layouts import layout_of_gguf

    layout = layout_of_gguf(ggml_type)
    if layout is None and ggml_type.name in ("F16", "BF16"):
        layout = ggml_type.name.lower()
        return None if HALF_LAYOUTS[layout] == dtype else layout
    return layout


def _packed_rows(data: np.ndarray, shape: tuple[int, ...], layout: str, dim: int | None,
                 runs: list[tuple[int, int]]) -> torch.Tensor | None:
    """GGUF block bytes ``data`` [rows, row bytes] of a 2-D tensor ``shape``, sliced: uint8 torch, or None when the
    slice cuts blocks; a 16-bit float tensor ("f16", "bf16") as torch float16 / bfloat16 [rows, cols]."""
    from dtorch.kernels.half import HALF_LAYOUTS
    from dtorch.kernels.layouts import block_size

    if dim == 1:
        block = 1 if layout in HALF_LAYOUTS else block_size(layout)
        per_block = data.shape[1] * block // shape[1]
        if any(a % block or n % block for a, n in runs):
            return None
        data = np.concatenate([data[:, a // block * per_block:(a + n) // block * per_block] for a, n in runs], 1)
    elif dim == 0 and runs:
        data = np.concatenate([data[a:a + n] for a, n in runs], 0)
    if layout in HALF_LAYOUTS:  # F16 maps as float16, BF16 as its bytes
        return torch.from_numpy(np.array(data, copy=True)).view(HALF_LAYOUTS[layout])
    return torch.from_numpy(np.array(data, dtype=np.uint8, copy=True))  # the map is read-only: one tensor's copy


def _gguf_reader(reader: Any, config: ModelConfig, path: Path,
                 dtype: torch.dtype = torch.float32) -> tuple[dict[str, tuple[int, ...]], Reader, Any, dict[str, str]]:
    """The HF-named shapes of the file's tensors, a ``Reader`` of their slices (Llama q/k un-permuted, the hybrids'
    tensors as transformers holds them), its packed reader and each tensor's quantization type."""
    views = {}
    arch = _arch(config)
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        if name is not None:
            views[name] = View((t,), gguf_shape(t))
    if config.family in HYBRID_FAMILIES:
        hybrid_views(views, config, path)
    if config.family == "gemma3":  # the converter stores Gemma's (1 + w) norms with the 1 added
        for name in [n for n in views if n.endswith("norm.weight")]:
            views[name] = View(views[name].parts, views[name].shape, value=lambda w: w - 1)
    shapes = {name: v.shape for name, v in views.items()}
    types = {name: v.parts[0].tensor_type.name for name, v in views.items()}
    heads = {}
    if config.family == "llama":  # llama.cpp permutes each head's rows of q and k; a run of whole heads undoes alone
        heads = {n: (config.num_heads if ".q_proj." in n else config.num_kv_heads) for n in views
                 if ".self_attn.q_proj." in n or ".self_attn.k_proj." in n}

    def read(name: str, dim: int | None, runs: list[tuple[int, int]]) -> torch.Tensor:
        v, d = views[name], config.head_dim
        if not v.plain:
            return _read_view(v, dim, runs, path)
        t = v.parts[0]
        if name not in heads:
            return _read_runs(t, dim, runs, path)
        if dim == 0 and all(a % d == 0 and n % d == 0 for a, n in runs):
            parts = [unpermute_qk(_read_runs(t, 0, [(a, n)], path), n // d) for a, n in runs]
            return parts[0] if len(parts) == 1 else torch.cat(parts, 0)
        return narrow_runs(unpermute_qk(_read_runs(t, None, [], path), heads[name]), dim, runs)

    def read_packed(name: str, dim: int | None, runs: list[tuple[int, int]]) -> tuple[str, torch.Tensor] | None:
        """(layout, GGUF bytes uint8 [rows, row bytes]) of the slice, or None when the tensor is not in a block
        format the kernels keep (or the slice cuts its blocks, or its values are changed): then ``read``
        dequantizes it instead. A view that only reorders or joins rows is served packed. A 16-bit float tensor of a
        model computing in another dtype comes as ("f16" | "bf16", its values [rows, cols])."""
        v = views[name]
        layouts = {stored_layout(t.tensor_type, dtype) for t in v.parts}
        layout = layouts.pop() if len(layouts) == 1 else None
        if layout is None or len(v.shape) != 2 or v.cols is not None or v.value is not None:
            return None
        data = v.parts[0].data if len(v.parts) == 1 else np.concatenate([t.data for t in v.parts], 0)
        if v.rows is not None:
            data = data[v.rows.numpy()]
        if name in heads:
            d = config.head_dim
            if dim == 0 and not all(a % d == 0 and n % d == 0 for a, n in runs):
                return None
            rows = _packed_rows(data, v.shape, layout, dim, runs)
            return None if rows is None else (layout, unpermute_qk(rows, rows.shape[0] // d).contiguous())
        rows = _packed_rows(data, v.shape, layout, dim, runs)
        return None if rows is None else (layout, rows)

    def released(fn: Callable) -> Callable:
        """``fn``, then the pages of the file map under the tensor dropped (``_release``): what was read is a copy."""
        def read_then_release(name: str, dim: int | None, runs: list[tuple[int, int]]) -> Any:
            try:
                return fn(name, dim, runs)
            finally:
                _release(reader, views[name].parts)
        return read_then_release

    return shapes, released(read), released(read_packed), types


def check_tensor_layout(reader: Any, path: Path) -> None:
    """Every tensor's bytes lie inside the file's data section, start at a multiple of ``general.alignment`` (32 when
    absent) from it, as llama.cpp writes them, and overlap no other tensor's. Raises ``ModelError`` naming the
    tensor."""
    size, start, align = path.stat().st_size, int(reader.data_offset), int(reader.alignment)
    spans = []
    for t in reader.tensors:
        lo, n = int(t.data_offset), int(t.n_bytes)
        if (lo - start) % align:
            raise ModelError(f"{path}: tensor {t.name!r} starts at byte {lo - start} of the data section; expected a "
                             f"multiple of general.alignment = {align}")
        if lo + n > size:
            raise ModelError(f"{path}: truncated: tensor {t.name!r} needs bytes [{lo}, {lo + n}) but the file has "
                             f"{size}")
        spans.append((lo, lo + n, t.name))
    spans.sort()
    for (_, end, a), (lo, _, b) in zip(spans, spans[1:], strict=False):
        if lo < end:
            raise ModelError(f"{path}: tensors {a!r} and {b!r} overlap (bytes [{lo}, {end}) of the file); expected "
                             "each tensor's bytes to be its own")


def open_gguf(path: str | Path, dtype: torch.dtype = torch.float32, check_finite: bool = True) -> LazyCheckpoint:
    """Open a GGUF file without reading its weights: config from its metadata (types and ranges checked), tensor
    offsets, alignment, names and shapes checked, the memory it implies compared with what is available, and its
    tokenizer; the returned ``LazyCheckpoint.get`` dequantizes only the blocks of the slices asked for, and refuses
    non-finite values unless ``check_finite`` is False."""
    from dtorch.models.tokenizer import Tokenizer

    path = regular_file(path, "a .gguf model file")
    reader = _open(path)
    check_tensor_layout(reader, path)  # the reader maps lazily: bad offsets would show only when read
    meta = read_metadata(reader, path)
    reader.fields.clear()  # read: its views of every vocabulary string (~80 MB for 49k tokens) go before the weights
    freqs = [dequantize(t, path) for t in reader.tensors if t.name == "rope_freqs.weight"]
    config = config_from_gguf(meta, {t.name for t in reader.tensors}, path, freqs[0] if freqs else None)
    shapes, read, read_packed, types = _gguf_reader(reader, config, path, dtype)
    packed = {hf_name(t.name, _arch(config)): int(t.n_bytes) for t in reader.tensors
              if stored_layout(t.tensor_type, dtype) is not None}
    shapes = used_shapes(shapes, config, dtype, str(path), gguf_keys(meta["general.architecture"]), packed)
    types = {name: types[name] for name in shapes}
    template = meta.get("tokenizer.chat_template")
    tokenizer = Tokenizer.from_gguf(meta, chat_template=template, source=str(path)) \
        if "tokenizer.ggml.tokens" in meta else None
    scalars = {k: v for k, v in meta.items() if not isinstance(v, list)}  # the vocabulary stays in the tokenizer
    return LazyCheckpoint(config=config, shapes=shapes, read=read, dtype=dtype, tokenizer=tokenizer,
                          source=str(path), chat_template=template, read_packed=read_packed,
                          metadata={"tensor_types": types, "gguf": scalars}, check_finite=check_finite,
                          stored=_stored_formats(reader, types, _arch(config)))


def _arch(config: ModelConfig) -> str:
    """The general.architecture of a family's files."""
    return next(a for a, f in _FAMILIES.items() if f == config.family)


def _stored_formats(reader: Any, types: dict[str, str], arch: str) -> dict[str, tuple[str, str, float]]:
    """HF name -> (the file's tensor name, its GGUF type name, bits per weight) of every tensor the model uses."""
    import gguf

    names = {hf_name(t.name, arch): t.name for t in reader.tensors}
    out = {}
    for name, kind in types.items():
        qtype = gguf.GGMLQuantizationType[kind]
        block, size = gguf.GGML_QUANT_SIZES.get(qtype, (1, 4))
        out[name] = (names.get(name, name), kind, size * 8 / block)
    return out


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, check_finite: bool = True) -> Checkpoint:
    """Load a GGUF file: config from its metadata, weights dequantized (Llama q/k un-permuted; Qwen2/Qwen3 q/k are
    stored as transformers has them), its tokenizer (see ``open_gguf``)."""
    with open_gguf(path, dtype, check_finite) as lazy:
        return lazy.load()


def load_gguf_tokenizer(path: str | Path) -> Any:
    """Only the tokenizer of a GGUF file (no weights are read), or None when the file has no vocabulary."""
    from dtorch.models.tokenizer import Tokenizer

    path = regular_file(path, "a .gguf model file")
    meta = read_metadata(_open(path), path)
    if "tokenizer.ggml.tokens" not in meta:
        return None
    return Tokenizer.from_gguf(meta, chat_template=meta.get("tokenizer.chat_template"), source=str(path))
