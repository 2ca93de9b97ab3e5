"""Where a model's files are: ``find_model(name)`` turns what a user passes (a ``.gguf`` file, a Hugging Face model
directory, a directory holding one ``.gguf``, or a Hugging Face id such as ``HuggingFaceTB/SmolLM2-135M-Instruct``
found in the local Hugging Face cache) into a ``.gguf`` file or a model directory. Nothing is ever downloaded."""

from __future__ import annotations

import os
import re
from pathlib import Path

from dtorch.core.errors import ModelError
from dtorch.models.loaders.files import regular_file

_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # "org/name", as the Hub spells repository ids


def find_model(name: str | Path) -> Path:
    """The ``.gguf`` file or Hugging Face model directory ``name`` stands for.

    name: a ``.gguf`` file; a directory with a ``config.json``; a directory holding exactly one ``.gguf``; or, when no
    such path exists, a Hugging Face id ("org/name") whose snapshot is in the local Hugging Face cache. Raises
    ``ModelError`` saying what was looked at and how to point at the model otherwise.
    """
    p = Path(name).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        return _in_directory(p)
    if os.path.lexists(p):  # a FIFO, a device, a socket, a dangling link: refused before anything opens it
        return regular_file(p, "a .gguf file or a model directory")
    text = str(name)
    if _HF_ID.match(text) and not text.startswith("."):
        return _in_directory(hf_cache_snapshot(text))
    raise ModelError(f"model {text!r} does not exist; expected a .gguf file, a Hugging Face model directory "
                     "(config.json + model.safetensors or pytorch_model.bin), a directory holding one .gguf, or a "
                     "Hugging Face id (org/name) in the local Hugging Face cache")


def _in_directory(directory: Path) -> Path:
    """``directory`` itself when it holds a ``config.json`` (or no ``.gguf``: ``open_hf`` says what is missing), else
    its one ``.gguf``."""
    if os.path.lexists(directory / "config.json"):  # open_hf refuses it unless a regular file
        return directory
    ggufs = sorted(f for f in directory.glob("*.gguf") if f.is_file())
    if len(ggufs) == 1:
        return ggufs[0]
    if len(ggufs) > 1:
        names = ", ".join(f.name for f in ggufs)
        raise ModelError(f"{directory}: holds {len(ggufs)} .gguf files ({names}); pass one of them, e.g. "
                         f"--model {ggufs[0]}")
    return directory


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, as ``huggingface_hub`` finds it: ``HF_HUB_CACHE``, else ``HF_HOME``/hub, else
    ``$XDG_CACHE_HOME``/huggingface/hub, else ~/.cache/huggingface/hub (Hugging Face's variables, not dtorch flags)."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    cache = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return cache / "huggingface" / "hub"


def hf_cache_snapshot(model_id: str) -> Path:
    """The snapshot directory of Hugging Face model ``model_id`` ("org/name") in the local cache: the revision
    ``refs/main`` names, else the only one there. Raises ``ModelError`` when it is not cached (nothing is
    downloaded)."""
    cache = hf_cache_dir()
    repo = cache / ("models--" + model_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = snapshots / ref.read_text(encoding="utf-8").strip()
        if snapshot.is_dir():
            return snapshot
    found = sorted(d for d in snapshots.iterdir() if d.is_dir()) if snapshots.is_dir() else []
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        raise ModelError(f"model {model_id!r}: the Hugging Face cache holds {len(found)} revisions of it in "
                         f"{snapshots} and refs/main names none of them; pass one snapshot directory as the model")
    raise ModelError(f"model {model_id!r} is neither a file nor a directory, and the local Hugging Face cache "
                     f"({cache}) does not hold it; dtorch downloads nothing. Download it first with "
                     f"`hf download {model_id}` (or `huggingface-cli download {model_id}`), which puts it in that "
                     "cache, or pass a .gguf file or a model directory")
