"""``python -m dtorch chat``: the conversation's state under each command, and the REPL fed through a pipe."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from dtorch.engine.chat import Conversation, _converse


def test_conversation_keeps_turns_and_applies_commands():
    chat = Conversation("Be brief.")
    assert chat.command("Hello") is None  # not a command: the user's turn
    assert chat.ask("Hello") == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    chat.answer("Hi!")
    assert [m["role"] for m in chat.ask("And you?")] == ["system", "user", "assistant", "user"]
    assert chat.command("/reset") == "(conversation cleared)"
    assert chat.messages == [{"role": "system", "content": "Be brief."}]
    assert "conversation cleared" in chat.command("/system Answer in French.")
    assert chat.messages == [{"role": "system", "content": "Answer in French."}]
    assert chat.command("/system") == "(system prompt removed)" and chat.messages == []
    assert "unknown command /nope; commands: /reset, /system TEXT, /exit" in chat.command("/nope")
    assert not chat.done and chat.command("/exit") == "" and chat.done


class _FakeLLM:
    """Records the conversations it is asked to answer; answers "answer N" (after a think block, with
    ``think``), a few characters at a time."""

    def __init__(self, think: bool = False) -> None:
        self.asked: list[list[dict]] = []
        self.think = think

    def chat_setup(self, messages, chat_template_kwargs=None):
        from dtorch.engine.chat_format import ChatSetup

        self.asked.append([dict(m) for m in messages])
        return ChatSetup([1, 2, 3], reasoning=self.think)

    def generate(self, _ids, _params, on_text):
        text = f"<think>hmm {len(self.asked)}</think>\n\n" * self.think + f"answer {len(self.asked)}"
        for at in range(0, len(text), 3):
            on_text(0, text[at:at + 3])
        return [SimpleNamespace(outputs=[SimpleNamespace(text=text)])]


def test_each_turn_sends_the_whole_conversation(monkeypatch, capsys):
    llm = _FakeLLM()
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is 2 + 2?\n\n/system Be terse.\nAnd 3 + 3?\nThen?\n/exit\nx\n"))
    assert _converse(llm, Conversation(), None, tty=False) == 0
    assert capsys.readouterr().out == "answer 1\nanswer 2\nanswer 3\n"  # the line after /exit is never read
    first, second, third = llm.asked
    assert first == [{"role": "user", "content": "What is 2 + 2?"}]
    assert second == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "And 3 + 3?"}]
    assert third == second + [{"role": "assistant", "content": "answer 2"}, {"role": "user", "content": "Then?"}]


def test_reasoning_is_shown_apart_or_hidden_and_kept_out_of_the_history(monkeypatch, capsys):
    for hide, shown in ((False, "hmm 1\nanswer 1\nhmm 2\nanswer 2\n"), (True, "answer 1\nanswer 2\n")):
        llm = _FakeLLM(think=True)
        monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\nAgain\n"))
        assert _converse(llm, Conversation(), None, tty=False, hide_reasoning=hide) == 0
        assert capsys.readouterr().out == shown  # not a terminal: no escape codes
        assert llm.asked[1][1] == {"role": "assistant", "content": "answer 1"}


def test_chat_through_a_pipe_answers_each_line():
    proc = subprocess.run([sys.executable, "-m", "dtorch", "chat", "--max-tokens", "8", "--system", "Be brief."],
                          input="What is the capital of France?\n/reset\nWhat is 2 + 2?\n", capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    answers = proc.stdout.splitlines()
    assert len(answers) == 2 and all(a.strip() for a in answers), proc.stdout
    assert "Paris" in answers[0]
    assert "(conversation cleared)" in proc.stderr


def test_chat_and_generate_take_the_same_model_options(monkeypatch, capsys):
    """-tp, --dequantize and --max-model-len (the context length) reach the LLM from chat as from generate."""
    import dtorch.engine.llm
    from dtorch.cli import main
    from dtorch.core.errors import DtorchError

    seen = []

    def record(model, **kwargs):
        seen.append(kwargs)
        raise DtorchError("recorded")  # instead of loading

    monkeypatch.setattr(dtorch.engine.llm, "LLM", record)
    flags = ["-tp", "2", "--dequantize", "--max-model-len", "64"]
    assert main(["chat", *flags]) == 2 and main(["generate", "hi", *flags]) == 2
    assert capsys.readouterr().err.count("dtorch: error: recorded") == 2
    for kwargs in seen:
        assert (kwargs["tensor_parallel_size"], kwargs["dequantize"], kwargs["max_model_len"]) == (2, True, 64)
    assert main(["chat"]) == 2 and seen[-1]["tensor_parallel_size"] == 1 and seen[-1]["max_model_len"] is None


class _Interrupted(_FakeLLM):
    """Its first answer gets ``sigints`` SIGINTs (the terminal's Ctrl-C) after its second piece; the engine's
    ``abort_all`` ends the answer, as the real engine ends an aborted request's sequences at once."""

    def __init__(self, sigints: int) -> None:
        super().__init__()
        self.sigints, self.aborted = sigints, 0
        self.engine = SimpleNamespace(abort_all=self._abort)

    def _abort(self) -> None:
        self.aborted += 1

    def generate(self, _ids, _params, on_text):
        import signal

        text, aborted = f"answer {len(self.asked)} is long", self.aborted
        for at in range(0, len(text), 3):
            if self.aborted > aborted:  # this answer's request was aborted
                break
            on_text(0, text[at:at + 3])
            if at == 3 and len(self.asked) == 1:
                for _ in range(self.sigints):
                    os.kill(os.getpid(), signal.SIGINT)
        return []


def test_ctrl_c_during_an_answer_stops_it_and_keeps_the_conversation(monkeypatch, capsys):
    import signal

    llm = _Interrupted(sigints=1)
    monkeypatch.setattr(sys, "stdin", io.StringIO("First?\nSecond?\n"))
    handler = signal.getsignal(signal.SIGINT)
    assert _converse(llm, Conversation(), None, tty=True) == 0  # back at the prompt, then end of input
    out, err = capsys.readouterr()
    assert llm.aborted == 1 and "(answer stopped)" in err
    assert out == ">>> answer\n>>> answer 2 is long\n>>> "  # the stopped answer ends where Ctrl-C came
    assert llm.asked[1] == [{"role": "user", "content": "First?"}, {"role": "assistant", "content": "answer"},
                            {"role": "user", "content": "Second?"}]
    assert signal.getsignal(signal.SIGINT) is handler  # Ctrl-C at the prompt exits again


def test_a_second_ctrl_c_during_an_answer_exits(monkeypatch, capsys):
    llm = _Interrupted(sigints=2)
    monkeypatch.setattr(sys, "stdin", io.StringIO("First?\nSecond?\n"))
    assert _converse(llm, Conversation(), None, tty=True) == 130
    assert len(llm.asked) == 1 and capsys.readouterr().out == ">>> answer\n"


def test_a_stopped_answer_leaves_nothing_in_the_engine(monkeypatch, capsys):
    """The default model: Ctrl-C after a few pieces aborts the request (finish_reason "abort", fewer tokens than
    asked), frees every block, leaves no thread, and the next turn answers with the stopped one in its history."""
    import signal
    import threading

    from dtorch import LLM, SamplingParams

    llm = LLM(max_model_len=256, max_num_seqs=1, threads=1)
    llm.generate([1, 2, 3], SamplingParams(max_tokens=2))  # starts the stream threads
    threads = threading.active_count()
    asked, outs = [], []

    class Proxy:
        engine = llm.engine

        def chat_setup(self, messages, chat_template_kwargs=None):
            asked.append([dict(m) for m in messages])
            return llm.chat_setup(messages, chat_template_kwargs=chat_template_kwargs)

        def generate(self, ids, params, on_text):
            pieces = []

            def hook(index, piece):
                pieces.append(piece)
                if len(pieces) == 3 and len(asked) == 1:
                    os.kill(os.getpid(), signal.SIGINT)
                on_text(index, piece)
            outs.extend(llm.generate(ids, params, on_text=hook))
            return outs[-1:]

    monkeypatch.setattr(sys, "stdin", io.StringIO("Count from 1 to 100.\nSay hi.\n"))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    try:
        assert _converse(Proxy(), Conversation(), params, tty=True) == 0
        stopped, answered = (o.outputs[0] for o in outs)
        assert stopped.finish_reason == "abort" and len(stopped.token_ids) < 24
        assert answered.finish_reason == "length" and len(answered.token_ids) == 24
        stats = llm.engine.stats()
        assert stats.running == stats.waiting == 0 and not llm.engine.has_unfinished()
        assert llm.engine.blocks.num_used == 0  # no sequence holds a block
        assert threading.active_count() == threads
        shown = capsys.readouterr().out.split("\n")[0].removeprefix(">>> ")
        assert asked[1][1] == {"role": "assistant", "content": shown} and shown
    finally:
        llm.close()


@pytest.mark.usefixtures("sigint_default")  # SIGINT not ignored in the chat started
def test_ctrl_c_in_a_terminal_stops_the_answer_then_exits_at_the_prompt():
    """Through a pseudo-terminal (the line discipline turns ^C into SIGINT): Ctrl-C mid-answer returns to the prompt
    and the next turn is answered; Ctrl-C at the prompt ends the session with status 130."""
    import pty
    import select
    import time

    pid, fd = pty.fork()
    if pid == 0:  # the child: chat on the terminal
        os.execvpe(sys.executable, [sys.executable, "-m", "dtorch", "chat", "--max-tokens", "400", "--threads", "1",
                                    "--max-model-len", "512"], {**os.environ, "OMP_NUM_THREADS": "1"})
    seen = bytearray()
    end = time.monotonic() + 300

    def until(done) -> None:  # read the terminal until done() or the time is up
        while not done():
            assert time.monotonic() < end, f"timed out; the terminal showed: {bytes(seen[-2000:])!r}"
            if select.select([fd], [], [], 1)[0]:
                try:
                    seen.extend(os.read(fd, 4096))
                except OSError:  # the child closed the terminal
                    raise AssertionError(f"the chat ended early: {bytes(seen[-2000:])!r}") from None

    def after(pattern: bytes, start: int) -> int:
        until(lambda: seen.find(pattern, start) >= 0)
        return seen.find(pattern, start) + len(pattern)

    try:
        at = after(b">>> ", 0)
        assert b"context 512" in seen  # the loaded line
        os.write(fd, b"Tell me a long story about a dragon and a knight.\r")
        at = after(b"\n", after(b"knight.", at))  # the terminal's echo of the line
        until(lambda: len(seen) > at + 40)  # the answer streams
        os.write(fd, b"\x03")
        at = after(b">>> ", after(b"(answer stopped)", at))
        os.write(fd, b"Say hi.\r")
        at = after(b">>> ", after(b"hi.", at))  # answered, back at the prompt
        # Ctrl-C at the prompt. A ^C that lands between readline printing ">>> " and its select() is only seen
        # at the next key (CPython's readline checks signals when select() is interrupted), so a busy machine may
        # need a second one, as a person would press it; it is Ctrl-C at the prompt all the same.
        done, status, sent = 0, 0, 0.0
        while not done:  # within the time left: a child that stays never hangs the suite
            assert time.monotonic() < end, f"Ctrl-C at the prompt did not end the chat: {bytes(seen[-2000:])!r}"
            if time.monotonic() - sent > 3:
                os.write(fd, b"\x03")
                sent = time.monotonic()
            time.sleep(0.1)
            done, status = os.waitpid(pid, os.WNOHANG)
        pid = 0
        assert os.waitstatus_to_exitcode(status) == 130, bytes(seen[-2000:])
        assert b"Traceback" not in seen
    finally:
        if pid:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(fd)
