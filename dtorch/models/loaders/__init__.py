"""Model weight loaders: ``load_checkpoint(path)`` for a ``.gguf`` file or a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path

import torch

from dtorch.core.errors import ModelError
from dtorch.models.loaders.checkpoint import Checkpoint as Checkpoint, expected_shapes as expected_shapes
from dtorch.models.loaders.gguf import load_gguf as load_gguf, load_gguf_tokenizer as load_gguf_tokenizer
from dtorch.models.loaders.hf import load_hf as load_hf


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Load a model from a ``.gguf`` file or a Hugging Face directory; weights cast to ``dtype``, PERSISTENT."""
    p = Path(path)
    if p.is_dir():
        return load_hf(p, dtype)
    if p.is_file():
        return load_gguf(p, dtype)
    raise ModelError(f"load_checkpoint: {str(path)!r} does not exist; expected a .gguf file or a Hugging Face "
                     "model directory (config.json + model.safetensors)")
