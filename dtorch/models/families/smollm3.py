"""SmolLM3: Llama whose every few layers do not rotate q and k (NoPE). ``no_rope_layers`` holds a 1 for each layer
with RoPE and a 0 for each without (transformers' default: every ``no_rope_layer_interval``-th layer, 4); llama.cpp's
converter writes no key for them (it converts SmolLM3 as Llama, q/k rows permuted) and its loader takes every fourth
layer as NoPE."""

from __future__ import annotations

from typing import Any

from dtorch.core.errors import ModelError
from dtorch.models.families.base import TINY_DENSE, Family, GgufMeta, all_full_attention

_INTERVAL = 4  # transformers' default no_rope_layer_interval, and llama.cpp's fixed one


def _every(interval: int, layers: int) -> tuple[int, ...]:
    """The NoPE layers of a model of ``layers`` layers with one every ``interval``-th."""
    return tuple(i for i in range(layers) if (i + 1) % interval == 0)


def _hf_config(c: dict[str, Any], source: str) -> dict[str, Any]:
    if c.get("use_sliding_window"):
        raise ModelError(f"{source}: use_sliding_window=true is not supported for smollm3 models; expected false")
    layers, flags = c["num_hidden_layers"], c.get("no_rope_layers")
    if flags is None:
        interval = c.get("no_rope_layer_interval", _INTERVAL)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ModelError(f"{source}: no_rope_layer_interval must be an int >= 1, got {interval!r}")
        return dict(nope_layers=_every(interval, layers))
    if len(flags) < layers or any(f not in (0, 1) or isinstance(f, bool) for f in flags):
        raise ModelError(f"{source}: no_rope_layers must hold a 1 (RoPE) or 0 (NoPE) for each of the "
                         f"{layers} layers, got {flags!r}")
    return dict(nope_layers=tuple(i for i in range(layers) if flags[i] == 0))


def _gguf_config(m: GgufMeta, common: dict[str, Any]) -> dict[str, Any]:
    return dict(nope_layers=_every(_INTERVAL, common["num_layers"]))


FAMILY = Family(
    name="smollm3", hf_types=("smollm3",), gguf_arch="smollm3",
    hf_keys={"nope_layers": "no_rope_layers", "sliding_window": "sliding_window"},
    hf_config=_hf_config, gguf_config=_gguf_config, gguf_permute_qk=True, hf_rope_theta=2_000_000.0,
    hf_read=("no_rope_layer_interval", "use_sliding_window"), hf_inert={"layer_types": all_full_attention},
    # four layers: the fourth without RoPE (transformers' default no_rope_layers, and llama.cpp's)
    tiny={"smollm3": ("SmolLM3Config", dict(TINY_DENSE, num_hidden_layers=4, pad_token_id=0))},
)
