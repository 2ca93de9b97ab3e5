"""``dtorch generate``: stream a model's answer to one prompt, then print prefill and decode speed.

The prompt is the argument, ``-`` (read from stdin) or ``--file PATH``. ``-tp n`` runs the model tensor parallel:
on n devices of this process, or, under ``torchrun --nproc-per-node n`` (or ``python -m torch.distributed.run``),
on one device per rank, every rank running the same steps (SPMD). Only rank 0 prints; every rank leaves the
process group before it exits. Ctrl-C stops the answer, prints the speed so far and exits 130.

The model and sampling options (``engine/options.py``) are shared with ``dtorch chat`` (``dtorch/engine/chat.py``)
and, for the model ones, ``dtorch serve``.
"""

from __future__ import annotations

import argparse
import os
import sys

from dtorch.core.errors import ArgumentError, DtorchError
from dtorch.engine.options import (
    INTERRUPTED,
    ReplyPrinter,
    add_load_arguments,
    add_model_arguments,
    add_reply_arguments,
    add_sampling_arguments,
    add_structured_arguments,
    load_and_announce,
    print_speed,
    sampling_params,
    stats_since,
    template_kwargs,
)


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """The prompt and the options of ``dtorch generate``."""
    parser.add_argument("prompt", nargs="?", default=None,
                        help="the prompt (sent through the model's chat template unless --raw); - reads it from stdin")
    parser.add_argument("--file", default=None, metavar="PATH", help="read the prompt from this file")
    parser.add_argument("--prompt-ids", type=token_ids, default=None, metavar="ID,..",
                        help="the prompt as token ids (comma or space separated), sent as is; works without a "
                             "tokenizer, and then prints the answer's ids")
    add_model_arguments(parser)
    add_load_arguments(parser, "devices to split the model over (default: the world size under torchrun, else 1)")
    add_sampling_arguments(parser)
    add_structured_arguments(parser)
    add_reply_arguments(parser)
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="record every kernel of the run on its stream and write a Chrome trace JSON (under "
                             "torchrun each rank writes FILE with .rankN before the suffix); draw it with "
                             "`python -m dtorch trace FILE --png out.png`")


def token_ids(text: str) -> list[int]:
    """An argparse ``type``: token ids, comma or space separated ("1,2,3"), at least one, each an int >= 0."""
    parts = text.replace(",", " ").split()
    if not parts or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected token ids >= 0 separated by commas or spaces, got {text!r:.80}")
    return [int(p) for p in parts]


def read_prompt(args: argparse.Namespace) -> str | list[int]:
    """The prompt of the argument, of stdin (``-``), of ``--file``, or of ``--prompt-ids`` (a list of ids)."""
    given = [args.prompt is not None, args.file is not None, getattr(args, "prompt_ids", None) is not None]
    if sum(given) != 1:
        raise ArgumentError("generate: give the prompt as an argument, - to read it from stdin, or --file PATH, or "
                            "--prompt-ids ID,.. (one of them)")
    if given[2]:
        return args.prompt_ids
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
    if tp is None:  # the ranks not taken by pipeline stages
        tp = max(1, int(os.environ["WORLD_SIZE"]) // args.pipeline_parallel_size) if launched_by_torchrun() else 1
    try:
        return _generate(args, tp)
    finally:
        _leave_process_group()


def _generate(args: argparse.Namespace, tp: int) -> int:
    from dtorch.models.parallel import launched_by_torchrun

    text = read_prompt(args)
    params = sampling_params(args)
    kwargs = template_kwargs(args)  # a bad flag fails before the model loads
    llm = load_and_announce(args, tensor_parallel_size=tp, pipeline_parallel_size=args.pipeline_parallel_size,
                            pp_layers=args.pp_layers, dequantize=args.dequantize,
                            max_model_len=args.max_model_len)
    try:
        speaker = llm.rank == 0  # every rank runs every step; only rank 0 prints
        if isinstance(text, list) or args.raw or llm.need_tokenizer("text prompts").chat_template is None:
            prompt, reply = text, None

            def show(_index: int, piece: str) -> None:
                if speaker:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
        else:
            setup = llm.chat_setup([{"role": "user", "content": text}], chat_template_kwargs=kwargs)
            prompt, reply = setup.prompt_ids, ReplyPrinter(setup, args.hide_reasoning, speaker)
            show = reply

        if args.trace:
            llm.executor.set_trace(True)
        before = llm.engine.stats()
        try:
            out = llm.generate([prompt], params, on_text=show)[0]
        except KeyboardInterrupt:
            if speaker:
                sys.stdout.write("\n")
                sys.stdout.flush()
                print_speed(stats_since(llm, before))
            return INTERRUPTED
        if reply is not None:
            reply.end()
        if args.trace:
            base, suffix = os.path.splitext(args.trace)
            path = f"{base}.rank{llm.rank}{suffix}" if launched_by_torchrun() else args.trace
            try:
                llm.executor.tracer.write(path)
            except OSError as exc:
                raise DtorchError(f"--trace: cannot write {path}: {exc}") from None
        if speaker:
            if llm.tokenizer is None:  # no text to show: the answer's ids
                sys.stdout.write(" ".join(str(i) for c in out.outputs for i in c.token_ids))
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
