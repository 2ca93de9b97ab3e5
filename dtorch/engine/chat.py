"""``dtorch chat``: a conversation with a model in the terminal, kept through its chat template.

Each line is the user's next turn; the answer streams back. ``/system TEXT`` sets the system prompt (and starts
over), ``/reset`` starts over, ``/exit`` (or end of input) quits. When stdin is not a terminal, every line is a
turn and each answer ends with a newline. The whole conversation is sent each turn; the prefix cache finds the
blocks of what came before, so a turn prefills only its new part.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dtorch.core.errors import ModelError
from dtorch.engine.cli import (
    INTERRUPTED,
    ReplyPrinter,
    add_load_arguments,
    add_model_arguments,
    add_reply_arguments,
    add_sampling_arguments,
    load_and_announce,
    sampling_params,
    template_kwargs,
)

COMMANDS = "/reset, /system TEXT, /exit"


class Conversation:
    """The messages of a chat so far, and what each typed line does to them."""

    def __init__(self, system: str | None = None) -> None:
        self.system = system or None
        self.turns: list[dict[str, str]] = []
        self.done = False

    @property
    def messages(self) -> list[dict[str, str]]:
        """The system prompt (if any), then the user and assistant turns: the chat template's input."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def command(self, line: str) -> str | None:
        """Apply ``line`` if it is a command; returns what to tell the user ("" for nothing), or None when the
        line is the user's next turn."""
        if not line.startswith("/"):
            return None
        name, _, rest = line.partition(" ")
        if name in ("/exit", "/quit"):
            self.done = True
            return ""
        if name == "/reset":
            self.turns = []
            return "(conversation cleared)"
        if name == "/system":
            self.system, self.turns = rest.strip() or None, []
            return "(system prompt set; conversation cleared)" if self.system else "(system prompt removed)"
        return f"(unknown command {name}; commands: {COMMANDS})"

    def ask(self, text: str) -> list[dict[str, str]]:
        """Add the user's turn; returns the messages to answer."""
        self.turns.append({"role": "user", "content": text})
        return self.messages

    def answer(self, text: str) -> None:
        """Add the assistant's answer to the last turn."""
        self.turns.append({"role": "assistant", "content": text})


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``dtorch chat``."""
    parser.add_argument("--system", default=None, metavar="TEXT", help="the system prompt")
    add_model_arguments(parser)
    add_load_arguments(parser, "devices of this process to split the model over (default: 1)")
    add_sampling_arguments(parser)
    add_reply_arguments(parser)


def run_chat(args: argparse.Namespace) -> int:
    """Load the model and converse until /exit or end of input; returns the exit code."""
    params = sampling_params(args)
    kwargs = template_kwargs(args)
    tty = sys.stdin.isatty()
    if tty:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    llm = load_and_announce(args, tensor_parallel_size=args.tensor_parallel_size or 1, dequantize=args.dequantize,
                            max_model_len=args.max_model_len)
    try:
        if llm.tokenizer is None or llm.tokenizer.chat_template is None:
            raise ModelError(f"{llm.source}: the model has no chat template, so it cannot chat; use "
                             "`python -m dtorch generate --raw PROMPT` to complete text")
        if tty:
            print(f"dtorch chat: {llm.source}; commands: {COMMANDS}", file=sys.stderr, flush=True)
        return _converse(llm, Conversation(args.system), params, tty, kwargs, args.hide_reasoning)
    finally:
        llm.close()


def _converse(llm: Any, chat: Conversation, params: Any, tty: bool, kwargs: dict[str, Any] | None = None,
              hide_reasoning: bool = False) -> int:
    """Each line a turn; each reply streamed, its reasoning dimmed (or hidden), its content kept in the history."""
    while not chat.done:
        try:
            line = input(">>> ") if tty else sys.stdin.readline()
        except EOFError:
            line = ""
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return INTERRUPTED
        if not line:  # end of input
            if tty:
                print(file=sys.stderr)
            break
        line = line.strip()
        if not line:
            continue
        note = chat.command(line)
        if note is not None:
            if note:
                print(note, file=sys.stderr, flush=True)
            continue
        try:
            setup = llm.chat_setup(chat.ask(line), chat_template_kwargs=kwargs)
            reply = ReplyPrinter(setup, hide_reasoning)
            llm.generate(setup.prompt_ids, params, on_text=reply)
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            sys.stdout.flush()
            return INTERRUPTED
        content = reply.end()
        sys.stdout.write("\n")
        sys.stdout.flush()
        chat.answer(content)
    return 0
