"""The command line: ``python -m dtorch {kernels,explain,trace,generate,chat,bench,info,serve}``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from dtorch.core.dtypes import ALL_DTYPES, as_dtype, dtype_name
from dtorch.core.errors import DtorchError


def _kernels(args: argparse.Namespace) -> int:
    from dtorch.dispatch import dispatcher

    devices = [args.device] if args.device else ["cpu", "cuda"]
    rows = [r for d in devices for r in dispatcher.table(d) if r.active]
    if args.op:
        rows = [r for r in rows if args.op in r.key.op]
    # a row per (op, layout): quantized layouts ("gguf.q4_1") are rows of their own
    active = {(_row_name(r.key), r.key.device, r.key.dtype): r for r in rows}
    cols = [(d, dt) for d in devices for dt in ALL_DTYPES if any((k[1], k[2]) == (d, dt) for k in active)]
    names = sorted({k[0] for k in active})
    marks = _footnote_marks([active[(n, d, dt)] for n in names for d, dt in cols if (n, d, dt) in active])
    used: dict[str, tuple[str, set[str]]] = {}  # mark -> (its text, the ops whose cells carry it)

    def cell(name, d, dt) -> str:
        r = active.get((name, d, dt))
        if r is None:
            return "-"
        if not r.varies:
            return r.provider
        mark = marks[(r.provider, r.varies)]
        used.setdefault(mark, (r.varies, set()))[1].add(r.key.op)
        return mark

    head = ["op"] + [f"{d}/{_short(dt)}" for d, dt in cols]
    table = [[name] + [cell(name, d, dt) for d, dt in cols] for name in names]
    widths = [max(len(str(r[i])) for r in [head] + table) for i in range(len(head))]
    for row in [head] + table:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    print(f"\n{len(names)} ops; each cell is the active provider ('-': not registered). "
          "`python -m dtorch explain OP` shows every candidate.")
    for mark, (varies, ops) in sorted(used.items()):
        print(f"  {mark} ({', '.join(sorted(ops))}): the path depends on the call: {varies}")
    for d in devices:
        for backend, reason in sorted(dispatcher.unavailable(d).items()):
            print(f"  backend {backend!r} unavailable on {d}: {reason}")
    return 0


def _footnote_marks(rows) -> dict[tuple[str, str], str]:
    """(provider, varies text) -> the cell's mark: "native*" where a provider has one such text, "native*1",
    "native*2" ... where it has several (matmul's, attention's and MoE's differ)."""
    texts: dict[str, list[str]] = {}
    for r in rows:
        if r.varies and r.varies not in texts.setdefault(r.provider, []):
            texts[r.provider].append(r.varies)
    return {(p, t): f"{p}*{i if len(ts) > 1 else ''}" for p, ts in texts.items() for i, t in enumerate(ts, 1)}


def _row_name(key) -> str:
    return key.op if key.layout == "strided" else f"{key.op} [{key.layout}]"


def _short(dt) -> str:
    return {"float32": "f32", "float64": "f64", "bfloat16": "bf16", "float16": "f16", "int32": "i32",
            "int64": "i64"}.get(dtype_name(dt), dtype_name(dt))


def _explain(args: argparse.Namespace) -> int:
    from dtorch.dispatch import KernelKey, dispatcher

    key = KernelKey.of(args.op, args.device, as_dtype(args.dtype), args.layout)
    exp = dispatcher.explain(key)
    if not exp.rows:
        dispatcher.choose(key)  # raises KernelNotFound listing what is registered for the op
    print(exp)
    return 0


def _trace(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise DtorchError("trace draws with matplotlib, which is not installed; install it with: "
                          "pip install 'dtorch[plot]'") from None
    from dtorch.runtime.tracing import plot_chrome_trace

    plot_chrome_trace(args.file, args.png)  # a file it cannot read or write is an ArgumentError naming it
    print(f"wrote {args.png}")
    return 0


# name, help text, module, the module's add-arguments function, its run function
MODEL_COMMANDS = (
    ("generate", "generate text with an LLM (the default model unless --model)", "dtorch.engine.cli",
     "add_generate_arguments", "run_generate"),
    ("chat", "chat with an LLM in the terminal (commands: /reset, /system TEXT, /exit); reads one turn per line when "
     "stdin is not a terminal", "dtorch.engine.chat", "add_chat_arguments", "run_chat"),
    ("bench", "measure prefill and decode tokens per second (llama-bench's tests: ppP and tgN) over prompt and "
     "generation lengths, batch sizes, threads and -tp; a table of medians, or --json", "dtorch.engine.bench",
     "add_bench_arguments", "run_bench"),
    ("info", "load a model and show its family, shapes, formats and bytes as loaded, the kernels that run it, its chat "
     "template and the memory a context length needs", "dtorch.engine.info", "add_info_arguments", "run_info"),
    ("serve", "serve an LLM over OpenAI's HTTP API (/v1/chat/completions, /v1/completions)", "dtorch.serve.cli",
     "add_serve_arguments", "run_serve"),
)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, unless it is None, False or empty (the help then says what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == [] or \
                "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    import dtorch

    p = argparse.ArgumentParser(prog="dtorch", description="dtorch: kernels, graphs and LLM inference on torch",
                                formatter_class=_HelpFormatter)
    p.add_argument("--version", action="version", version=f"dtorch {dtorch.__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text, formatter_class=_HelpFormatter)

    k = command("kernels", "print the op x device x dtype matrix with the active provider of each")
    k.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="the device whose kernels to list")
    k.add_argument("--op", help="only ops whose name contains this")
    k.set_defaults(run=_kernels)

    e = command("explain", "print every candidate kernel of an op and which one is chosen")
    e.add_argument("op", help="the op's name, e.g. llm.rms_norm")
    e.add_argument("--device", default="cpu", help="the device of the call")
    e.add_argument("--dtype", default="float32", help="the dtype of the call")
    e.add_argument("--layout", default="strided", help="e.g. gguf.q4_1 for a quantized weight layout")
    e.set_defaults(run=_explain)

    t = command("trace", "draw a recorded Chrome trace as a per-stream timeline (needs dtorch[plot])")
    t.add_argument("file", help="the Chrome trace JSON (generate --trace FILE)")
    t.add_argument("--png", required=True, help="the image to write")
    t.set_defaults(run=_trace)

    # the commands that load a model: each module's flags and its run function (imported here; none imports the
    # server's packages, so a plain install without the serve extra builds this parser)
    for name, text, module, add, run in MODEL_COMMANDS:
        m = importlib.import_module(module)
        c = command(name, text)
        getattr(m, add)(c)
        c.set_defaults(run=getattr(m, run))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status: 0, 2 for a usage or dtorch error (a one-line message; with
    DTORCH_DEBUG=1 the traceback), 130 after Ctrl-C, 141 when stdout's reader went away (``| head``)."""
    from dtorch.core import env

    try:
        args = build_parser().parse_args(argv)
        return int(args.run(args) or 0)
    except DtorchError as exc:
        if env.debug():
            raise
        print(f"dtorch: error: {_rank_prefix()}{exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if env.debug():
            raise
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout's reader is gone: point stdout at /dev/null so the interpreter's final flush stays quiet too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _rank_prefix() -> str:
    """"rank r of n: " in a process started by torchrun (each rank reports its own error), else ""."""
    world, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK", "0")
    return f"rank {rank} of {world}: " if world.isdigit() and int(world) > 1 else ""
