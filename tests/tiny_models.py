"""The model tests' one factory: tiny random checkpoints of every family written by transformers (``tiny_config``,
``random_model``, ``save_random``: they live in ``dtorch.models.tiny``, shared with the benchmarks and the GPU check,
and are re-exported here), transformers' greedy ids (``hf_greedy``), and transformers' own reading of a GGUF file
(``transformers_gguf``, ``transformers_from_gguf``): the reference a llama.cpp file is checked against."""

from __future__ import annotations

from pathlib import Path

import torch

from dtorch.models.tiny import (
    families as families,
    hf_greedy as hf_greedy,
    random_model as random_model,
    save_random as save_random,
    tiny_config as tiny_config,
)


def transformers_gguf(path: str | Path) -> tuple[object, dict[str, torch.Tensor]]:
    """What transformers' own GGUF reader makes of ``path``: its config (``head_dim`` from ``attention.key_length``,
    which transformers' GGUF config leaves out) and every tensor, dequantized by gguf-py, under transformers' names
    (Llama's q/k un-permuted). Its reader needs no accelerate (``from_pretrained(gguf_file=)`` does)."""
    import gguf
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = Path(path)
    cfg = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    fields = gguf.GGUFReader(str(path)).fields
    arch = fields["general.architecture"].contents()
    if f"{arch}.attention.key_length" in fields:
        cfg.head_dim = fields[f"{arch}.attention.key_length"].contents()
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(cfg)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta)["tensors"]
    return cfg, {k: torch.as_tensor(v) for k, v in tensors.items()}


def transformers_from_gguf(path: str | Path):
    """A transformers model (float32, eval) holding ``transformers_gguf(path)``'s tensors: every parameter comes from
    the file but a tied LM head."""
    import transformers

    cfg, tensors = transformers_gguf(path)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    return hf
