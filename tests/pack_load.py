"""One load of a GGUF file through ``LLM`` for the pack-cache tests: each weight's layout and shape, the logits of a
few ids, and the pack cache's status, with the cache's write waited for and the LLM closed."""

from __future__ import annotations

from pathlib import Path


def load_packed(path: Path, ids: list[int]):
    """(``{name: (layout, shape)}``, logits of ``ids``, the pack cache's status or "off")."""
    from dtorch.engine.llm import LLM

    llm = LLM(path, max_model_len=32, max_num_seqs=1)
    try:
        status = llm.pack_cache.status if llm.pack_cache is not None else "off"
        if llm.pack_cache is not None:
            llm.pack_cache.wait()
        found = {name: (w.layout, tuple(w.shape)) for name, w in llm.model.weights.items()}
        return found, llm.logits(ids), status
    finally:
        llm.close()
