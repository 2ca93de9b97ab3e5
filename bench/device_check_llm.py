"""The LLM rows of ``bench/device_check.py``: models written on the spot (nothing downloaded or carried), decoded
greedily on every path, each compared with a reference.

- ``gguf``: a random Llama written as GGUF with its matrices in Q8_0, Q4_0 and Q4_1 (q, k and v each in another
  format: the projection runs as parts), kept packed: the CPU torch reference (dequantize, then multiply), the CPU
  native kernels, the device without triton (torch kernels) and the device's winners (triton), captured.
- ``hf``: the same Llama as a Hugging Face directory written by transformers, decoded by transformers on the device
  (the reference), by dtorch eager and captured, and tensor-parallel over 2 devices when there are 2.

Ids must agree with the reference; a path may leave it only at a near tie (the reference's top two log-probabilities
within ``TIE``), after which nothing is compared.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

import torch

Row = tuple[str, str, str, float | None, str]  # (check, devices, result, ms, note)
TIE = 0.05  # nats: two paths may pick different tokens where the reference's top two are closer than this
# GGUF tensor kind -> its format; the q, k and v of a layer differ, so their fused projection runs as three parts
FORMATS = {"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q4_1", "attn_output": "Q4_0", "ffn_gate": "Q4_1",
           "ffn_up": "Q4_1", "ffn_down": "Q8_0", "token_embd": "Q4_1", "output": "Q8_0"}
PROMPT = [1, 17, 42, 99, 7, 3, 120, 64]


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def write_models(root: Path, small: bool) -> tuple[object, Path, Path]:
    """(the transformers model on the CPU, its HF directory, its GGUF file); ``small``: the dry run's sizes."""
    import gguf
    import transformers

    from dtorch.models.tiny import families, save_random, write_gguf

    if small:
        sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=128)
        cfg = families(transformers, 4, 2, 256, 16, **sizes)["llama"]()
    else:  # head dim 64, GQA 2:1, every row a multiple of 32 (the block formats' block)
        sizes = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, max_position_embeddings=512)
        cfg = families(transformers, 8, 4, 4096, 64, **sizes)["llama"]()
    hf = save_random(transformers, cfg, root / "hf")
    Q = gguf.GGMLQuantizationType
    write_gguf(hf, root / "llama.gguf", qtype=lambda name: Q[FORMATS[name.split(".")[-2]]])
    return hf, root / "hf", root / "llama.gguf"


def agree(ref: tuple[list[int], list[dict[int, float]]], ids: list[int]) -> tuple[bool, str]:
    """Whether ``ids`` follow the reference (ids, per step {token: logprob} of its top tokens), and how."""
    want, tops = ref
    for i, (a, b) in enumerate(zip(want, ids, strict=False)):
        if a != b:
            gap = tops[i][a] - tops[i].get(b, float("-inf"))
            if gap < TIE:
                return True, f"equal up to token {i}, then a near tie ({gap:.3f} nats)"
            return False, f"token {i}: {b}, the reference {a} ({gap:.3f} nats above it)"
    if len(ids) != len(want):
        return False, f"{len(ids)} tokens, the reference {len(want)}"
    return True, f"{len(ids)} ids equal"


def dtorch_decode(path: Path, dev: str, tokens: int, off: tuple[str, ...] = (), tp: int = 1, eager: bool = True):
    """(ids, per step {token: logprob} of the top two, seconds of the timed run, the capture report (captured runs),
    the active provider of rms_norm) of a greedy decode by ``LLM`` with the providers ``off`` disabled."""
    import dtorch
    from dtorch import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=2)
    with dtorch.dispatcher.disabled(*off):
        llm = LLM(str(path), device=dev, tensor_parallel_size=tp, enforce_eager=eager, max_num_seqs=2,
                  max_model_len=128)
        try:
            llm.generate([PROMPT], dataclasses.replace(params, max_tokens=3))  # warm-up: compiled, decode recorded
            sync(dev)
            t0 = time.perf_counter()
            out = llm.generate([PROMPT], params)[0].outputs[0]
            sync(dev)
            seconds = time.perf_counter() - t0
            report = {} if eager else llm.capture_report()
            key = dtorch.KernelKey("llm.rms_norm", dev, torch.float32)
            provider = dtorch.dispatcher.select(key).provider
        finally:
            llm.close()
    tops = [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]
    return out.token_ids, tops, seconds, report, provider


def hf_reference(hf, dev: str, tokens: int) -> tuple[list[int], list[dict[int, float]], float]:
    """transformers' greedy decode on ``dev`` (a full forward per token, no cache, nothing masked): (ids, per step
    {token: logprob} of the top two, seconds)."""
    model, ids, tops = hf.to(dev), list(PROMPT), []
    with torch.no_grad():
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(tokens):
            lp = torch.log_softmax(model(torch.tensor([ids], device=dev)).logits[0, -1].float(), -1)
            v, i = lp.topk(2)
            tops.append(dict(zip(i.tolist(), v.tolist(), strict=True)))
            ids.append(int(i[0]))
        sync(dev)
        seconds = time.perf_counter() - t0
    model.to("cpu")
    return ids[len(PROMPT):], tops, seconds


def captured(report: dict[str, str]) -> str:
    decode = {k: v for k, v in report.items() if k.startswith("decode")}
    done = sum(v == "captured" for v in decode.values())
    why = next((v for v in decode.values() if v != "captured"), "")
    return f"{done}/{len(decode)} decode buckets captured" + (f" ({why[:60]})" if why else "")


def llm_rows(dev: str, n: int, small: bool) -> list[Row]:
    """Every LLM row, on ``dev`` ("cuda"; "cpu" in the dry run) with ``n`` devices of it; a path that raises is a FAIL
    row, and the others still run."""
    tokens = 6 if small else 16  # the CPU torch reference dequantizes every weight at every step
    with tempfile.TemporaryDirectory(prefix="device-check-") as tmp:
        t0 = time.perf_counter()
        hf, hf_dir, gguf_path = write_models(Path(tmp), small)
        rows: list[Row] = [("write llama hf + gguf", "cpu", "ok", (time.perf_counter() - t0) * 1e3,
                            f"{hf.config.num_hidden_layers} layers, hidden {hf.config.hidden_size}, "
                            f"gguf {gguf_path.stat().st_size / 2**20:.2f} MiB")]
        name = "gguf q8_0/q4_0/q4_1"
        ref = _row(rows, f"{name} cpu torch (reference)", "cpu", None, tokens,
                   lambda: dtorch_decode(gguf_path, "cpu", tokens, off=("native",)))
        for label, where, off, eager in (("cpu native", "cpu", (), True),
                                         (f"{dev} without triton", dev, ("triton",), True),
                                         (f"{dev} winners, captured", dev, (), False)):
            _row(rows, f"{name} {label}", where, ref, tokens,
                 lambda where=where, off=off, eager=eager: dtorch_decode(gguf_path, where, tokens, off=off,
                                                                         eager=eager))
        ref = _row(rows, "hf llama transformers (reference)", dev, None, tokens,
                   lambda: hf_reference(hf, dev, tokens))
        for label, tp, eager in [("eager", 1, True), ("captured", 1, False)] + ([("tp=2", 2, True)] if n > 1 else []):
            _row(rows, f"hf llama dtorch {label}", f"{dev} x{tp}", ref, tokens,
                 lambda tp=tp, eager=eager: dtorch_decode(hf_dir, dev, tokens, tp=tp, eager=eager))
    return rows


def _row(rows: list[Row], check: str, devices: str, ref, tokens: int, run):
    """Append the row of ``run()`` (a decode: ids, tops, seconds[, capture report, rms_norm's provider]) compared with
    ``ref`` (None: it is the reference); returns (ids, tops), or None when it failed."""
    try:
        ids, tops, seconds, *more = run()
    except Exception as exc:  # noqa: BLE001 - one failing path is a FAIL row, the others still run
        rows.append((check, devices, "FAIL", None, f"{type(exc).__name__}: {str(exc)[:180]}"))
        return None
    note = f"{tokens / seconds:.1f} tok/s"
    if more:
        report, provider = more
        note += f"; rms_norm: {provider}" + (f"; {captured(report)}" if report else "")
    result = "ok"
    if ref is not None:
        ok, how = agree(ref, ids)
        result, note = "ok" if ok else "FAIL", f"{how}; {note}"
    elif "reference" not in check:
        result, note = "ran", f"not compared: the reference failed; {note}"
    rows.append((check, devices, result, seconds * 1e3, note))
    return ids, tops
