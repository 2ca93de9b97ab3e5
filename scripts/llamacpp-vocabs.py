"""Fetch llama.cpp's tokenizer test suite and its model converter for the tests, from the source release of
llama-cpp-python 0.3.36 (which vendors llama.cpp), through pip as any package comes:

- the vocabulary-only GGUF files and their test strings with llama.cpp's expected ids (``models/ggml-vocab-*.gguf``,
  ``.gguf.inp``, ``.gguf.out``) and the vocabulary code that maps pre-tokenizer names to split regexes
  (``src/llama-vocab.cpp``), by base name;
- the converter from Hugging Face checkpoints to GGUF, as it imports itself: ``convert_hf_to_gguf.py``, its
  ``conversion/`` package and the ``gguf-py/`` it puts first on its path, under ``convert/``.

    python scripts/llamacpp-vocabs.py          # into ~/.cache/dtorch/llamacpp-vocabs/0.3.36 (skipped when there)

The tests read them there: tests/test_gguf_vocabs.py fails, naming this script, when the suite is missing; the family
tests (tests/family_check.py) skip their converter cases, naming it, when the converter is.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"
DEST = Path.home() / ".cache" / "dtorch" / "llamacpp-vocabs" / VERSION
DONE = DEST / "files.txt"  # written last: the list of files, once all are in place
CONVERTER = "convert/convert_hf_to_gguf.py"  # a cache made before the converter was kept lacks it: fetched again


def main() -> int:
    if complete():
        print(f"llama.cpp's vocabularies and converter are in {DEST}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={VERSION}", "-d", tmp], check=True)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        names = extract(sdist)
    if not any(n.endswith(".gguf.out") for n in names) or CONVERTER not in names:
        print(f"{sdist.name} has no models/ggml-vocab-*.gguf.out files or no convert_hf_to_gguf.py", file=sys.stderr)
        return 1
    DONE.write_text("\n".join(sorted(names)) + "\n")
    print(f"{len(names)} files of llama.cpp's tokenizer suite and converter in {DEST}")
    return 0


def complete() -> bool:
    """Whether ``DEST`` holds every file of a finished fetch, the converter among them."""
    if not DONE.is_file():
        return False
    names = DONE.read_text().split()
    return CONVERTER in names and all((DEST / n).is_file() for n in names)


def wanted(parts: list[str]) -> str | None:
    """Where a member of the sdist (its path split at "/") goes under ``DEST``, or None if not kept."""
    at = parts.index("llama.cpp") if "llama.cpp" in parts[:-1] else -1
    if at < 0 or parts[at - 1] != "vendor":
        return None
    rel = parts[at + 1:]
    if rel[:1] == ["models"] and len(rel) == 2 and rel[1].startswith("ggml-vocab-"):
        return rel[1]  # the suite
    if rel == ["src", "llama-vocab.cpp"]:
        return rel[1]
    if rel == ["convert_hf_to_gguf.py"] or (rel[0] == "conversion" and rel[-1].endswith(".py")) or \
            (rel[:2] == ["gguf-py", "gguf"] and not rel[-1].endswith((".pyc", ".pyi"))):
        return "/".join(["convert", *rel])  # the converter, laid out as it imports itself
    return None


def extract(sdist: Path) -> list[str]:
    """The files of ``sdist`` that ``wanted`` keeps, into ``DEST``; returns their paths under it."""
    DEST.mkdir(parents=True, exist_ok=True)
    names = []
    with tarfile.open(sdist) as tar:
        for member in tar:
            name = wanted(member.name.split("/")) if member.isfile() else None
            if name is None:
                continue
            data = tar.extractfile(member)
            assert data is not None
            (DEST / name).parent.mkdir(parents=True, exist_ok=True)
            (DEST / name).write_bytes(data.read())
            names.append(name)
    return names


if __name__ == "__main__":
    sys.exit(main())
