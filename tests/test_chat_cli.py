"""``python -m dtorch chat``: the conversation's state under each command, and the REPL fed through a pipe."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from types import SimpleNamespace

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
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"})
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
