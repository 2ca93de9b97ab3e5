"""Chat on Gemma 3, Mistral 7B Instruct, Phi-3 and Llama 2 as their files come: each family's own chat template, as
the model ships it (the GGUF's ``tokenizer.chat_template``), renders as transformers renders it (Gemma folds the
system turn into the first user turn, Llama 2 wraps it in ``<<SYS>>``); a template's ``raise_exception`` (Mistral's
roles that do not alternate) is a ``DtorchError`` naming the template's message and a 400 from the server, never a
500; a base model without a template says so for ``chat`` and completes text with ``generate --raw``."""

from __future__ import annotations

import pytest

from dtorch.core.errors import ArgumentError, DtorchError, ModelError
from tests.live_server import live_server
from tests.tiny_models import hf_greedy, save_random, tiny_config

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

# the templates as the models ship them (tokenizer_config.json's "chat_template"), data
GEMMA3 = (  # google/gemma-3-4b-it
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n")
MISTRAL = (  # mistralai/Mistral-7B-Instruct-v0.2
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
PHI3 = (  # microsoft/Phi-3.5-mini-instruct
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
LLAMA2 = (  # meta-llama/Llama-2-7b-chat-hf
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")

# family -> (the dtorch family its GGUF is, template, special tokens (ids 0..), bos, eos)
FAMILIES = {
    "gemma3": ("gemma3", GEMMA3, ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
               "<bos>", "<eos>"),
    "mistral": ("llama", MISTRAL, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>"),
    "phi3": ("phi3", PHI3, ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>",
                            "<|end|>"], "<s>", "<|endoftext|>"),
    "llama2": ("llama", LLAMA2, ["<unk>", "<s>", "</s>"], "<s>", "</s>"),
}
SYSTEM = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi there"}]
TURNS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "  2+2? "}]
NOT_ALTERNATING = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
ALTERNATE = "Conversation roles must alternate user/assistant/user/assistant/..."
GREEDY_N = 5


def _vocabulary(specials: list[str], template: str | None) -> tuple[list[str], dict]:
    """Byte-level BPE GGUF metadata: the specials (control tokens) first, then GPT-2's 256 byte letters and a few
    merges; the template as the file's tokenizer.chat_template."""
    from dtorch.models.tokenizer import _byte_alphabet

    V = gguf.GGUFValueType
    letters = list(_byte_alphabet().values())
    merged = ["Ġt", "he", "Ġthe"]
    tokens = specials + letters + merged
    meta = {"tokenizer.ggml.model": ("gpt2", V.STRING), "tokenizer.ggml.pre": ("qwen2", V.STRING),
            "tokenizer.ggml.tokens": (tokens, V.ARRAY),
            "tokenizer.ggml.token_type": ([3] * len(specials) + [1] * (len(tokens) - len(specials)), V.ARRAY),
            "tokenizer.ggml.merges": (["Ġ t", "h e", "Ġt he"], V.ARRAY)}
    if template is not None:
        meta["tokenizer.chat_template"] = (template, V.STRING)
    return tokens, meta


def _reference(template: str, messages: list[dict], bos: str, eos: str) -> str:
    """transformers' rendering of ``messages`` (a TemplateError where the template raises)."""
    return render_jinja_template(conversations=[messages], chat_template=template, bos_token=bos, eos_token=eos,
                                 add_generation_prompt=True)[0][0]


def _write(tmp_path_factory, name: str, template: str | None):
    """(LLM, transformers model) of a tiny random model of ``name``'s family, written as GGUF with its vocabulary and
    ``template``."""
    from dtorch import LLM
    from dtorch.models.tiny import write_gguf

    family, _, specials, bos, eos = FAMILIES[name]
    tokens, meta = _vocabulary(specials, template)
    path = tmp_path_factory.mktemp(f"chat-{name}")
    config = tiny_config(transformers, "mistral" if name == "mistral" else family, vocab_size=len(tokens),
                         bos_token_id=specials.index(bos), eos_token_id=specials.index(eos), pad_token_id=0)
    hf = save_random(transformers, config, path)
    write_gguf(hf, path / "m.gguf", metadata=meta)
    return LLM(str(path / "m.gguf"), max_num_seqs=2), hf


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_real_templates_render_as_transformers(name):
    """Our sandboxed rendering of each real template equals transformers' on valid conversations, and raises where
    it raises, naming the template's message."""
    from jinja2.exceptions import TemplateError
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel

    _, template, specials, bos, eos = FAMILIES[name]
    backend = Backend(WordLevel({t: i for i, t in enumerate(specials)}, unk_token=specials[0]))
    from dtorch.models.tokenizer import Tokenizer

    tok = Tokenizer(backend, bos_token_id=specials.index(bos), eos_token_ids=[specials.index(eos)],
                    chat_template=template, source=name)
    for messages in (SYSTEM, TURNS, NOT_ALTERNATING):
        try:
            want = _reference(template, messages, bos, eos)
        except TemplateError as e:
            with pytest.raises(ArgumentError, match=f"the model's template rejected the messages: {e}"):
                tok.apply_chat_template(messages)
            continue
        assert tok.apply_chat_template(messages) == want
    if name == "gemma3":  # the system turn folded into the first user turn
        assert tok.apply_chat_template(SYSTEM) == "<bos><start_of_turn>user\nBe terse.\n\nHi there<end_of_turn>\n" \
                                                  "<start_of_turn>model\n"
    if name == "llama2":
        assert tok.apply_chat_template(SYSTEM) == "<s>[INST] <<SYS>>\nBe terse.\n<</SYS>>\n\nHi there [/INST]"


@pytest.fixture(scope="module", params=["gemma3", "phi3", "llama2"])
def chat_model(request, tmp_path_factory):
    llm, hf = _write(tmp_path_factory, request.param, FAMILIES[request.param][1])
    yield request.param, llm, hf
    llm.close()


def test_chat_prompts_are_the_templates_and_replies_are_transformers(chat_model):
    from dtorch import SamplingParams

    name, llm, hf = chat_model
    _, template, _, bos, eos = FAMILIES[name]
    for messages in (SYSTEM, TURNS):
        ids = llm.chat_prompt(messages)
        assert llm.tokenizer.decode(ids, skip_special_tokens=False) == _reference(template, messages, bos, eos)
    out = llm.chat(SYSTEM, SamplingParams(temperature=0.0, max_tokens=GREEDY_N, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == hf_greedy(hf, llm.chat_prompt(SYSTEM), GREEDY_N)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    llm, _ = _write(tmp_path_factory, "mistral", MISTRAL)
    yield llm
    llm.close()


def test_a_template_that_raises_is_a_dtorch_error_naming_its_message(mistral):
    for messages in (NOT_ALTERNATING, SYSTEM):
        with pytest.raises(DtorchError, match=f"the model's template rejected the messages: {ALTERNATE}"):
            mistral.chat(messages)


def test_a_template_that_raises_is_a_400_from_the_server(mistral):
    with live_server(mistral) as post:
        for messages in (NOT_ALTERNATING, SYSTEM):
            for stream in (False, True):
                status, r = post("/v1/chat/completions", {"messages": messages, "max_tokens": 2, "stream": stream})
                assert status == 400 and ALTERNATE in r["error"]["message"], r
        status, r = post("/v1/chat/completions", {"messages": TURNS, "max_tokens": 2})
        assert status == 200 and r["usage"]["completion_tokens"] == 2, r


def test_a_base_model_without_a_template(tmp_path_factory, capsys):
    from dtorch import SamplingParams
    from dtorch.cli import main

    llm, hf = _write(tmp_path_factory, "llama2", None)
    try:
        with pytest.raises(ModelError, match="the model has no chat template"):
            llm.chat(TURNS)
        ids = llm.tokenizer.encode("the theme", add_special_tokens=False)
        out = llm.generate("the theme", SamplingParams(temperature=0.0, max_tokens=GREEDY_N, ignore_eos=True))
        assert out[0].prompt_token_ids[-len(ids):] == ids
        want = hf_greedy(hf, out[0].prompt_token_ids, GREEDY_N)
        assert out[0].outputs[0].token_ids == want
        source = llm.source
        expected = llm.tokenizer.decode(want)
    finally:
        llm.close()
    assert main(["chat", "--model", source]) == 2
    assert "the model has no chat template, so it cannot chat; use `python -m dtorch generate --raw PROMPT`" in \
        capsys.readouterr().err
    assert main(["generate", "--model", source, "--raw", "the theme", "--temperature", "0", "--max-tokens",
                 str(GREEDY_N), "--ignore-eos"]) == 0
    printed = capsys.readouterr().out.removesuffix("\n")
    assert printed.replace("\ufffd", "") == expected.replace("\ufffd", "")
