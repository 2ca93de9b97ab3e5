"""Make the test fixtures of ``tests/data/llamacpp/``: tiny random models quantized by llama.cpp's own quantizer.

    python bench/llamacpp_fixtures.py [--llamacpp-python PATH] [--out DIR] [--smoke]

Needs the llama.cpp venv (``../shared/tools/llamacpp-venv.sh .venv-llamacpp``); the tests only read the files.

Two models, one layer each (the F16 source is made in a temporary folder, then quantized without an imatrix):
- ``qwen3-256``: Qwen3 (q/k norms, tied embedding), every row length a multiple of 256, so the K-quant presets
  write K-quants (Q4_K_M: Q4_K, with Q6_K on attn_v, ffn_down and the embedding). Quantized to every preset of
  ``PRESETS_256``.
- ``llama-576``: Llama, hidden 576 like SmolLM2, so that no row length is a multiple of 256 and llama.cpp falls back
  (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL), and 576 = 18 blocks of 32 (a full group of 16
  blocks and a remainder in dtorch's packed rows). Quantized to ``PRESETS_576``.
The README of the folder lists each file's tensor types.

``--smoke`` (what CI runs): both F16 sources and one preset of each (Q4_K_M) into a temporary folder, nothing written
to ``--out``; without the llama.cpp venv only the sources, and it says so.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

import gguf_files as gf

from dtorch.models.default import default_model_path

OUT = gf.ROOT / "tests" / "data" / "llamacpp"
MODELS = {
    "qwen3-256": gf.Shape("qwen3", 256, 256, 1, 4, 1, 64, 384, context=256, scale=0.1, norm_noise=0.3),
    "llama-576": gf.Shape("llama", 576, 64, 1, 2, 1, 64, 320, context=256, rope_theta=1e4, eps=1e-5, scale=0.07,
                          norm_noise=0.3),
}
PRESETS_256 = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q2_K", "Q3_K_M", "IQ4_XS", "IQ4_NL", "Q5_0", "Q5_1", "Q4_0",
               "Q4_1")
PRESETS_576 = ("Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS")
PRESETS = {"qwen3-256": PRESETS_256, "llama-576": PRESETS_576}


def _row(path: Path) -> str:
    """The README's table row of ``path``: name, KiB, tensor types."""
    types = ", ".join(f"{t} {n}" for t, n in sorted(gf.tensor_types(path).items()))
    return f"| {path.name} | {path.stat().st_size // 1024} | {types} |"


def smoke(python: Path) -> None:
    """Both sources and one preset of each in a temporary folder; the quantizer only where ``python`` has it."""
    ok = python.exists() and subprocess.run([str(python), "-c", "import llama_cpp"]).returncode == 0
    print("| file | KiB | tensor types |\n|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in MODELS.items():
            src = gf.random_model(Path(tmp) / f"{name}-F16.gguf", shape, default_model_path())
            print(_row(src))
            if ok:
                print(_row(gf.quantize(src, Path(tmp) / f"{name}-Q4_K_M.gguf", "Q4_K_M", python)))
    if not ok:
        print(f"llama.cpp: skipped: {python} cannot import llama_cpp (build it with ../shared/tools/llamacpp-venv.sh);"
              " only the F16 sources were made")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llamacpp-python", type=Path, default=gf.LLAMACPP_PYTHON)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--smoke", action="store_true", help="a temporary folder, one preset per model (CI)")
    args = ap.parse_args()
    if args.smoke:
        smoke(args.llamacpp_python)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in MODELS.items():
            src = gf.random_model(Path(tmp) / f"{name}-F16.gguf", shape, default_model_path())
            for preset in PRESETS[name]:
                dst = args.out / f"{name}-{preset}.gguf"
                dst.unlink(missing_ok=True)
                gf.quantize(src, dst, preset, args.llamacpp_python)
                rows.append(_row(dst))
                print(rows[-1])
    readme = [
        "# GGUF files made by llama.cpp's quantizer",
        "",
        "Made by `python bench/llamacpp_fixtures.py` (llama-cpp-python's `llama_model_quantize`, built by",
        "`../shared/tools/llamacpp-venv.sh`, no imatrix) from tiny random F16 models written with gguf-py: see the",
        "script's docstring for their shapes. Read by `tests/test_llamacpp_files.py`; the tests do not need llama.cpp.",
        "",
        "| file | KiB | tensor types |",
        "|---|---|---|",
        *rows,
        "",
    ]
    (args.out / "README.md").write_text("\n".join(readme))


if __name__ == "__main__":
    main()
