"""Fetch llama.cpp's tokenizer test suite for the tests: the vocabulary-only GGUF files and their test strings with
llama.cpp's expected ids (``models/ggml-vocab-*.gguf``, ``.gguf.inp``, ``.gguf.out``), and the vocabulary code that
maps pre-tokenizer names to split regexes (``src/llama-vocab.cpp``), from the source release of llama-cpp-python
0.3.36 (which vendors llama.cpp), through pip as any package comes.

    python scripts/llamacpp-vocabs.py          # into ~/.cache/dtorch/llamacpp-vocabs/0.3.36 (skipped when there)

The tests (tests/test_gguf_vocabs.py) read them there and fail, naming this script, when they are missing.
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


def main() -> int:
    if DONE.is_file() and all((DEST / n).is_file() for n in DONE.read_text().split()):
        print(f"llama.cpp's vocabularies are in {DEST}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={VERSION}", "-d", tmp], check=True)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        names = extract(sdist)
    if not any(n.endswith(".gguf.out") for n in names):
        print(f"{sdist.name} has no models/ggml-vocab-*.gguf.out files", file=sys.stderr)
        return 1
    DONE.write_text("\n".join(sorted(names)) + "\n")
    print(f"{len(names)} files of llama.cpp's tokenizer suite in {DEST}")
    return 0


def extract(sdist: Path) -> list[str]:
    """The ``vendor/llama.cpp/models/ggml-vocab-*`` files and ``src/llama-vocab.cpp`` of ``sdist`` into ``DEST`` (by
    base name only)."""
    DEST.mkdir(parents=True, exist_ok=True)
    names = []
    with tarfile.open(sdist) as tar:
        for member in tar:
            parts = member.name.split("/")
            suite = parts[-3:-1] == ["llama.cpp", "models"] and parts[-1].startswith("ggml-vocab-")
            if member.isfile() and (suite or parts[-3:] == ["llama.cpp", "src", "llama-vocab.cpp"]):
                data = tar.extractfile(member)
                assert data is not None
                (DEST / parts[-1]).write_bytes(data.read())
                names.append(parts[-1])
    return names


if __name__ == "__main__":
    sys.exit(main())
