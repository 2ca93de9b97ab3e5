"""Model weight loaders for a ``.gguf`` file or a Hugging Face directory: ``open_checkpoint(path)`` reads only
the config, tokenizer and tensor shapes, then the slices asked for; ``load_checkpoint(path)`` reads everything."""

from __future__ import annotations

from pathlib import Path

import torch

from dtorch.core.errors import ModelError
from dtorch.models.loaders.checkpoint import (
    Checkpoint as Checkpoint,
    LazyCheckpoint as LazyCheckpoint,
    expected_shapes as expected_shapes,
)
from dtorch.models.loaders.gguf import (
    load_gguf as load_gguf,
    load_gguf_tokenizer as load_gguf_tokenizer,
    open_gguf as open_gguf,
)
from dtorch.models.loaders.hf import load_hf as load_hf, open_hf as open_hf


def open_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32) -> LazyCheckpoint:
    """Open a ``.gguf`` file or a Hugging Face directory: config, tokenizer and tensor names and shapes (checked
    against the config) without reading weights; ``.get(hf_name, dim, runs)`` reads slices cast to ``dtype``.
    Close it (or use ``with``) when done."""
    p = Path(path)
    if p.is_dir():
        return open_hf(p, dtype)
    if p.is_file():
        return open_gguf(p, dtype)
    raise ModelError(f"checkpoint {str(path)!r} does not exist; expected a .gguf file or a Hugging Face "
                     "model directory (config.json + model.safetensors)")


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Load a model from a ``.gguf`` file or a Hugging Face directory; weights cast to ``dtype``, PERSISTENT."""
    with open_checkpoint(path, dtype) as lazy:
        return lazy.load()
