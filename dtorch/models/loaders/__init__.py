"""Model weight loaders for a ``.gguf`` file or a Hugging Face directory (found by ``find_model``: a path, a
directory holding one ``.gguf``, or a Hugging Face id in the local cache): ``open_checkpoint(path)`` reads only the
config, tokenizer and tensor shapes, then the slices asked for; ``load_checkpoint(path)`` reads everything."""

from __future__ import annotations

from pathlib import Path as _Path

import torch as _torch

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
from dtorch.models.loaders.source import find_model as find_model

__all__ = ["Checkpoint", "LazyCheckpoint", "expected_shapes", "find_model", "load_checkpoint", "load_gguf",
           "load_gguf_tokenizer", "load_hf", "open_checkpoint", "open_gguf", "open_hf"]


def open_checkpoint(path: str | _Path, dtype: _torch.dtype = _torch.float32,
                    check_finite: bool = True) -> LazyCheckpoint:
    """Open a ``.gguf`` file or a Hugging Face directory (or what ``find_model`` makes of ``path``: a directory
    holding one ``.gguf``, a Hugging Face id in the local cache): config, tokenizer and tensor names and shapes
    (checked against the config) without reading weights; ``.get(hf_name, dim, runs)`` reads slices cast to
    ``dtype``, refusing non-finite values unless ``check_finite`` is False. Every file is untrusted: types, ranges,
    offsets and the memory it implies are checked before anything is allocated. Close it (or use ``with``) when
    done."""
    p = find_model(path)
    return open_hf(p, dtype, check_finite) if p.is_dir() else open_gguf(p, dtype, check_finite)


def load_checkpoint(path: str | _Path, dtype: _torch.dtype = _torch.float32, check_finite: bool = True) -> Checkpoint:
    """Load a model from a ``.gguf`` file or a Hugging Face directory; weights cast to ``dtype``, PERSISTENT (see
    ``open_checkpoint``)."""
    with open_checkpoint(path, dtype, check_finite) as lazy:
        return lazy.load()
