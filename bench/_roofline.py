"""The roofline of one-sequence decode (``gguf_formats.py``'s roofline table): the bytes a decode step must read, and
the tok/s the machine's read rate allows at most.

A decode step of a dense model reads every weight the token passes through once: every tensor of the GGUF file but
the token embedding, of which it reads one row, unless the file has no ``output.weight`` (a tied head: the whole
embedding is then read as the head's weight). And the keys and values of the positions before it, in every layer.
Both engines read at least these bytes; the file says how many (gguf-py's reader: each tensor's stored bytes, and
the model's shape from its metadata), so the count is the same for both whatever their layouts (dtorch's 16-row
interleaved layouts hold a weight in exactly its rows' bytes).

``roof tok/s`` = read GB/s / GB a step, the read in 2 MiB pages (where ``LLM`` holds the weights). llama.cpp reads
its mmap of the file in the page cache's 4 KiB pages, so its share of the roof at the read in 4 KiB pages is shown
too: near 1 there, llama.cpp is bound by its pages. An engine's share of the roof is its tok/s over the roof: a row
where llama.cpp already sits at a share s cannot reach x times its rate where x * s > 1 ("1.3x lcpp / roof").
"""

from __future__ import annotations

from pathlib import Path

EMBEDDING, HEAD = "token_embd.weight", "output.weight"
TARGET = 1.3  # issue #39: decode >= 1.3x llama.cpp


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return max(value) if isinstance(value, list) else value  # per-layer arrays (head_count_kv): the largest


def step_bytes(path: str | Path, position: float, kv_element: int = 2) -> dict[str, float]:
    """{"weights": bytes of the weights a decode step reads, "kv": bytes of keys and values read at ``position`` (the
    tokens before the step) with ``kv_element`` bytes an element (2: llama.cpp's float16 cache and dtorch's
    bfloat16), "bytes": their sum, "tied": 1.0 when the head is the embedding, else 0.0}. Every layer's attention is
    taken as reading all ``position`` positions: a sliding window shorter than ``position`` makes it an upper
    bound (the bench's decode ends at 192 tokens, under the windows of its files)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    rows = {t.name: int(t.shape[-1]) if len(t.shape) > 1 else 1 for t in reader.tensors}  # gguf shapes: [K, N]
    tied = HEAD not in sizes
    weights = sum(sizes.values())
    if EMBEDDING in sizes and not tied:
        weights -= sizes[EMBEDDING] - sizes[EMBEDDING] // rows[EMBEDDING]  # one row of it
    arch = _field(reader, "general.architecture")
    layers = int(_field(reader, f"{arch}.block_count", 0))
    heads = int(_field(reader, f"{arch}.attention.head_count", 0))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    width = int(_field(reader, f"{arch}.embedding_length", 0))
    key = int(_field(reader, f"{arch}.attention.key_length", width // heads if heads else 0))
    value = int(_field(reader, f"{arch}.attention.value_length", key))
    kv = layers * kv_heads * (key + value) * kv_element * position
    return {"weights": float(weights), "kv": float(kv), "bytes": float(weights + kv), "tied": float(tied)}


def row(name: str, threads: int, step: dict[str, float] | None, read_gbs: float | None, lcpp: float | None,
        dtorch: float | None, read_4k: float | None = None, target: float = TARGET) -> list:
    """One row of the roofline table: file, threads, MB a step (weights + KV), read GB/s (2 MiB pages), roof tok/s,
    each engine's tok/s and share of the roof, llama.cpp's share of the roof in 4 KiB pages (``read_4k``: it reads
    the weights through its mmap of the file, in the page cache's 4 KiB pages), and ``target`` x llama.cpp's tok/s
    over the roof (over 1: out of reach)."""
    mb = step["bytes"] / 1e6 if step else None
    roof = read_gbs * 1e9 / step["bytes"] if step and read_gbs else None
    roof_4k = read_4k * 1e9 / step["bytes"] if step and read_4k else None

    def share(v: float | None, of: float | None) -> float | None:
        return v / of if v and of else None

    return [name, threads, f"{mb:.0f} ({step['kv'] / 1e6:.1f})" if step else None, read_gbs, roof, lcpp,
            share(lcpp, roof), share(lcpp, roof_4k), dtorch, share(dtorch, roof),
            target * share(lcpp, roof) if share(lcpp, roof) else None]


COLUMNS = ["file", "thr", "MB a step (KV)", "read GB/s", "roof tok/s", "lcpp tg", "lcpp / roof", "lcpp / roof 4K",
           "dtorch tg", "dtorch / roof", f"{TARGET}x lcpp / roof"]
