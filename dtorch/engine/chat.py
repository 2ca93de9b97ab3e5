"""``dtorch chat``: a conversation with a model in the terminal, kept through its chat template.

Each line is the user's next turn; the answer streams back. ``/system TEXT`` sets the system prompt (and starts
over), ``/reset`` starts over, ``/exit`` (or end of input) quits. When stdin is not a terminal, every line is a
turn and each answer ends with a newline. The whole conversation is sent each turn; the prefix cache finds the
blocks of what came before, so a turn prefills only its new part.

On a terminal, Ctrl-C while an answer streams stops that answer (its request is aborted at the next step boundary,
its cache blocks freed) and returns to the prompt, the conversation kept with the part of the answer shown; a second
Ctrl-C before that, or Ctrl-C at the prompt, exits (status 130).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from dtorch.core.errors import ModelError
from dtorch.engine.options import (
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

    def withdraw(self) -> None:
        """Drop the last user turn (its answer was stopped before any of it was shown)."""
        if self.turns and self.turns[-1]["role"] == "user":
            self.turns.pop()


class StopAnswer:
    """SIGINT while an answer streams (a context manager, on the main thread): the first one marks the answer to stop,
    which ``on_text`` does between engine steps (``stop``); a second one raises ``KeyboardInterrupt`` at once."""

    def __init__(self) -> None:
        self.asked = self.done = False
        self._previous = None

    def __enter__(self) -> StopAnswer:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._interrupt)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _interrupt(self, _sig: int, _frame: object) -> None:
        if self.asked:
            raise KeyboardInterrupt
        self.asked = True

    def stop(self, llm: Any) -> bool:
        """Whether the answer is stopped; the first time after Ctrl-C, abort it: the engine ends its sequences now
        (they free their blocks) and ``generate`` returns with what was made."""
        if self.asked and not self.done:
            llm.engine.abort_all()  # chat runs one request at a time: its own
            self.done = True
        return self.done


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
    llm = load_and_announce(args, tensor_parallel_size=args.tensor_parallel_size or 1,
                            pipeline_parallel_size=args.pipeline_parallel_size, pp_layers=args.pp_layers,
                            dequantize=args.dequantize,
                            max_model_len=args.max_model_len)
    try:
        if llm.need_tokenizer("chat").chat_template is None:
            raise ModelError(f"{llm.source}: the model has no chat template, so it cannot chat; use "
                             "`python -m dtorch generate --raw PROMPT` to complete text")
        if tty:
            print(f"dtorch chat: commands: {COMMANDS}; Ctrl-C stops an answer, and exits at the prompt",
                  file=sys.stderr, flush=True)
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
            stopped = _answer(llm, setup.prompt_ids, params, reply, tty)
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            sys.stdout.flush()
            return INTERRUPTED
        content = reply.end()
        sys.stdout.write("\n")
        sys.stdout.flush()
        if stopped:
            print("(answer stopped)", file=sys.stderr, flush=True)
        if content or not stopped:
            chat.answer(content)
        else:
            chat.withdraw()  # nothing of it was shown: as if it was never asked
    return 0


def _answer(llm: Any, prompt_ids: list[int], params: Any, reply: ReplyPrinter, tty: bool) -> bool:
    """Stream the answer to ``reply``; on a terminal, Ctrl-C stops it (``StopAnswer``). Returns whether it was
    stopped."""
    if not tty:
        llm.generate(prompt_ids, params, on_text=reply)
        return False
    with StopAnswer() as stopper:
        def show(index: int, piece: str) -> None:
            if not stopper.stop(llm):
                reply(index, piece)

        llm.generate(prompt_ids, params, on_text=show)
    return stopper.done
