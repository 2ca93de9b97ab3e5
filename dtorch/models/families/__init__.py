"""The model families dtorch runs, one module each, found here: every module of this package with a ``FAMILY`` is one.

A ``Family`` (``families.base``) declares all a family's knowledge: its config keys and fields (Hugging Face and GGUF),
its tensor table (both formats' names, shapes, tensor-parallel split) and the changes llama.cpp's converter makes to
its tensors. ``ModelConfig``, the loaders and the weight placement look a family up here and keep no family knowledge
of their own. ``register`` adds one at run time (a family written outside dtorch).
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from typing import TYPE_CHECKING

from dtorch.core.errors import ModelError
from dtorch.models.families.base import (
    Family as Family,
    GgufMeta as GgufMeta,
    Source as Source,
    View as View,
    Weight as Weight,
)

if TYPE_CHECKING:
    from dtorch.models.config import ModelConfig

__all__ = ["Family", "GgufMeta", "Source", "View", "Weight", "by_gguf_arch", "by_hf_type", "get", "gguf_archs",
           "hf_types", "names", "register", "sources"]

_lock = threading.Lock()
_families: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add ``family``; its name, ``model_type`` s and GGUF architecture must be new. Returns it."""
    if not isinstance(family, Family):
        raise ModelError(f"families.register: expected a Family, got {type(family).__name__}")
    with _lock:
        taken = [f"name {family.name!r}" for f in _families.values() if f.name == family.name]
        types = family.hf_types + family.hf_multimodal
        taken += [f"model_type {t!r} ({f.name})" for f in _families.values() for t in types
                  if t in f.hf_types + f.hf_multimodal]
        taken += [f"architecture {family.gguf_arch!r} ({f.name})" for f in _families.values()
                  if family.gguf_arch is not None and f.gguf_arch == family.gguf_arch]
        if taken:
            raise ModelError(f"families.register: {family.name!r} claims what another family has: {', '.join(taken)}")
        _families[family.name] = family
    return family


def get(name: str) -> Family:
    """The family ``name`` (``ModelConfig.family``)."""
    fam = _families.get(name) if isinstance(name, str) else None
    if fam is None:
        raise ModelError(f"no model family {name!r}; known: {', '.join(names())}")
    return fam


def names() -> tuple[str, ...]:
    """Every family's name, in registration order."""
    return tuple(_families)


def by_hf_type(model_type: object) -> Family | None:
    """The family reading a ``config.json`` of ``model_type`` (its own or a multimodal one's text model), or None."""
    return next((f for f in _families.values() if model_type in f.hf_types + f.hf_multimodal), None)


def by_gguf_arch(arch: object) -> Family | None:
    """The family reading GGUF files of ``general.architecture`` ``arch``, or None."""
    return next((f for f in _families.values() if f.gguf_arch is not None and f.gguf_arch == arch), None)


def hf_types() -> tuple[str, ...]:
    """Every ``model_type`` some family reads."""
    return tuple(t for f in _families.values() for t in f.hf_types + f.hf_multimodal)


def gguf_archs() -> tuple[str, ...]:
    """Every GGUF ``general.architecture`` some family reads."""
    return tuple(f.gguf_arch for f in _families.values() if f.gguf_arch is not None)


def sources(config: ModelConfig) -> dict[str, Source]:
    """Every checkpoint tensor a model of ``config`` runs, by Hugging Face name: its family's tensor table (as one
    device reads it) flattened. Their shapes are what a checkpoint must hold; their llama.cpp names what a GGUF does."""
    from dtorch.models.layout import Layout

    return {s.hf: s for w in get(config.family).tensors(config, Layout(config, 1)) for s in w.sources}


def _discover() -> None:
    """Register the ``FAMILY`` of every module of this package, in name order."""
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        family = getattr(importlib.import_module(f"{__name__}.{info.name}"), "FAMILY", None)
        if family is not None:
            register(family)


_discover()
