"""GGUF block bytes of every packed layout, for tests that compare against gguf's own dequantize.

Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 bytes come from gguf's quantize of Gaussian weights. gguf 0.19 cannot quantize the K-quants
or the IQ4 formats (NotImplementedError), so those are random blocks with realistic fp16 scales at the offsets
FP16_SCALES names: any other bytes make a valid block, and the reference is still gguf's dequantize of the same bytes.
(tests/test_llamacpp_files.py runs files that llama.cpp's own quantizer wrote.)
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

FP16_SCALES = {"gguf.q4_k": (0, 2), "gguf.q5_k": (0, 2), "gguf.q6_k": (208,), "gguf.q2_k": (80, 82),
               "gguf.q3_k": (108,), "gguf.iq4_xs": (0,), "gguf.iq4_nl": (0,)}


def qtype(fmt: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[fmt[5:].upper()]


def gguf_bytes(fmt: str, n: int, k: int, gen: np.random.Generator) -> np.ndarray:
    """uint8 [n, GGUF row bytes] of a weight [n, k] in ``fmt``."""
    if fmt not in FP16_SCALES:
        return gguf_quantize(gen.standard_normal((n, k), dtype=np.float32), qtype(fmt))
    block, size = gguf.GGML_QUANT_SIZES[qtype(fmt)]
    raw = gen.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for at in FP16_SCALES[fmt]:  # d (and dmin); the sub-block scales stay random
        raw[..., at:at + 2] = gen.uniform(1e-3, 1e-2, size=(n, k // block, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def gguf_reference(fmt: str, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    """gguf's dequantize of ``raw`` as float32 [n, k]."""
    return torch.from_numpy(np.asarray(gguf_dequantize(raw, qtype(fmt)), dtype=np.float32).reshape(n, k))
