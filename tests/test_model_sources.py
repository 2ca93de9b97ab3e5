"""Models from where users keep them: a directory holding one .gguf, a Hugging Face id in the local cache (never
downloaded), ``pytorch_model.bin`` checkpoints, Mistral as the Llama it is, a model without a tokenizer, and a
tokenizer smaller than the model's vocabulary."""

from __future__ import annotations

import json

import pytest
import torch

from dtorch import ModelError
from dtorch.engine.llm import LLM
from dtorch.engine.sampling import SamplingParams
from dtorch.models import ModelConfig, default_model_path, load_checkpoint, open_checkpoint
from dtorch.models.loaders import find_model
from dtorch.models.tokenizer import no_tokenizer_message
from tests.tiny_models import families, save_random, tiny_config

transformers = pytest.importorskip("transformers")

FAMILIES = families(transformers, heads=4, kv_heads=2, vocab=128, qwen3_head_dim=32)


def _logits_match(hf, llm, n: int = 23) -> None:
    ids = torch.randint(3, 128, (n,)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(llm.logits(ids), want, rtol=1e-4, atol=1e-4)


# --- a directory holding .gguf files -------------------------------------------------------------------------------

def test_directory_with_one_gguf_loads_it(tmp_path):
    (tmp_path / "model.gguf").symlink_to(default_model_path())
    (tmp_path / "README.md").write_text("not a model")
    assert find_model(tmp_path) == tmp_path / "model.gguf"
    with open_checkpoint(tmp_path) as lazy:
        assert lazy.source == str(tmp_path / "model.gguf")
        assert lazy.config.num_layers == ModelConfig.preset("smollm2-135m").num_layers == 30


def test_directory_with_several_ggufs_lists_them(tmp_path):
    for name in ("a.Q4_1.gguf", "a.Q8_0.gguf"):
        (tmp_path / name).symlink_to(default_model_path())
    with pytest.raises(ModelError, match=r"holds 2 .gguf files \(a.Q4_1.gguf, a.Q8_0.gguf\); pass one of them, "
                                         r"e.g. --model .*a.Q4_1.gguf"):
        open_checkpoint(tmp_path)


# --- Hugging Face ids in the local cache -----------------------------------------------------------------------

def _cache(root, model_id: str, revision: str = "0123abcd", ref: bool = True):
    """A Hugging Face hub cache at ``root`` holding an empty snapshot of ``model_id``; returns the snapshot dir."""
    repo = root / ("models--" + model_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    if ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture
def no_hf_env(monkeypatch, tmp_path):
    """No Hugging Face cache variables set, home in tmp_path, and a working directory without an "org" folder."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return monkeypatch


def test_hf_id_loads_from_the_cache(tmp_path, no_hf_env):
    no_hf_env.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = _cache(tmp_path / "hub", "org/tiny-llama")
    _cache(tmp_path / "hub", "org/old", ref=False)  # a snapshot but no refs/main: the only snapshot
    hf = save_random(transformers, FAMILIES["llama"](), snapshot)
    with open_checkpoint("org/tiny-llama") as lazy:
        assert lazy.source == str(snapshot)
        assert lazy.config == ModelConfig.from_hf(hf.config.to_dict())
    assert find_model("org/old") == tmp_path / "hub" / "models--org--old" / "snapshots" / "0123abcd"


@pytest.mark.parametrize("where", ["HF_HOME", "XDG_CACHE_HOME", "HOME"])
def test_hf_cache_location_follows_huggingface_hub(tmp_path, no_hf_env, where):
    root = tmp_path / "root"
    hub = {"HF_HOME": root / "hub", "XDG_CACHE_HOME": root / "huggingface" / "hub",
           "HOME": tmp_path / "home" / ".cache" / "huggingface" / "hub"}[where]
    if where != "HOME":
        no_hf_env.setenv(where, str(root))
    snapshot = _cache(hub, "org/m")
    (snapshot / "m.gguf").symlink_to(default_model_path())  # a GGUF repository: its one .gguf
    assert find_model("org/m") == snapshot / "m.gguf"


def test_hf_id_not_in_the_cache_is_not_downloaded(tmp_path, no_hf_env):
    no_hf_env.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelError, match=r"model 'org/missing' is neither a file nor a directory, and the local "
                                         r"Hugging Face cache \(.*hub\) does not hold it; dtorch downloads nothing. "
                                         r"Download it first with `hf download org/missing`"):
        open_checkpoint("org/missing")
    _cache(tmp_path / "hub", "org/two", "aaa", ref=False)
    _cache(tmp_path / "hub", "org/two", "bbb", ref=False)
    with pytest.raises(ModelError, match="holds 2 revisions of it .* pass one snapshot directory"):
        open_checkpoint("org/two")
    with pytest.raises(ModelError, match="model '/no/such/model.gguf' does not exist; expected a .gguf file"):
        open_checkpoint("/no/such/model.gguf")


# --- pytorch_model.bin ---------------------------------------------------------------------------------------

def _to_bin(hf, directory, shards: int = 1) -> dict[str, torch.Tensor]:
    """``directory`` with its safetensors replaced by ``pytorch_model.bin`` (or ``shards`` files and an index)."""
    for f in directory.glob("model*.safetensors*"):
        f.unlink()
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    if shards == 1:
        torch.save(state, directory / "pytorch_model.bin")
        return state
    names = list(state)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        file = f"pytorch_model-{s + 1:05d}-of-{shards:05d}.bin"
        torch.save({k: state[k] for k in part}, directory / file)
        weight_map |= dict.fromkeys(part, file)
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return state


def test_pytorch_bin_matches_transformers(tmp_path):
    hf = save_random(transformers, FAMILIES["qwen2"](), tmp_path)
    _to_bin(hf, tmp_path)
    _logits_match(hf, LLM(str(tmp_path), max_num_seqs=2))


def test_sharded_pytorch_bin_slices(tmp_path):
    hf = save_random(transformers, FAMILIES["llama"](), tmp_path)
    state = _to_bin(hf, tmp_path, shards=3)
    assert not list(tmp_path.glob("*.safetensors")) and len(list(tmp_path.glob("*.bin"))) == 3
    ck = load_checkpoint(tmp_path)
    assert set(ck.tensors) == set(state) and all(torch.equal(t, state[k]) for k, t in ck.tensors.items())
    q = "model.layers.1.self_attn.q_proj.weight"
    with open_checkpoint(tmp_path, torch.bfloat16) as lazy:
        got = lazy.get(q, 0, [(16, 16), (48, 8)])
        assert got.dtype == torch.bfloat16 and got.untyped_storage().nbytes() == got.numel() * 2
        assert torch.equal(got, torch.cat([state[q][16:32], state[q][48:56]]).bfloat16())
        assert torch.equal(lazy.get("model.norm.weight"), state["model.norm.weight"].bfloat16())


class _NotATensor:
    pass


def test_unreadable_pytorch_bin(tmp_path):
    hf = save_random(transformers, FAMILIES["llama"](), tmp_path)
    _to_bin(hf, tmp_path)
    torch.save({"model.norm.weight": _NotATensor()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelError, match="pytorch_model.bin: not a readable PyTorch checkpoint"):
        open_checkpoint(tmp_path)
    torch.save({"model.norm.weight": [1, 2]}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelError, match=r"expected a state dict of tensors, found non-tensor entries "
                                         r"\['model.norm.weight'\]"):
        open_checkpoint(tmp_path)
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(ModelError, match="no weights found; expected model.safetensors, .*pytorch_model.bin"):
        open_checkpoint(tmp_path)


# --- Mistral ---------------------------------------------------------------------------------------------------

def test_mistral_runs_as_llama_past_its_window(tmp_path):
    hf = save_random(transformers, tiny_config(transformers, "mistral", sliding_window=32), tmp_path)
    llm = LLM(str(tmp_path), max_num_seqs=2)
    assert llm.config.family == "llama" and llm.config.max_position_embeddings == 128 and llm.max_len == 128
    assert [llm.config.window(i) for i in range(2)] == [32, 32]
    _logits_match(hf, llm, n=100)  # every layer sees only the last 32 keys, as transformers' sliding mask


def test_mistral_config_without_a_window():
    c = transformers.MistralConfig(sliding_window=None, max_position_embeddings=4096).to_dict()
    assert ModelConfig.from_hf(c).max_position_embeddings == 4096 and ModelConfig.from_hf(c).kv_window is None
    for window in (8192, 1024):
        slides = ModelConfig.from_hf(c | {"sliding_window": window})
        assert slides.max_position_embeddings == 4096 and slides.kv_window == window
    assert ModelConfig.from_hf(c) == ModelConfig.from_hf(c | {"model_type": "llama"})


# --- tokenizers ----------------------------------------------------------------------------------------------

def test_no_tokenizer_message_says_what_to_add(tmp_path):
    save_random(transformers, FAMILIES["llama"](), tmp_path)
    assert load_checkpoint(tmp_path).tokenizer is None
    msg = no_tokenizer_message(str(tmp_path), "text prompts")
    assert msg.startswith(f"{tmp_path}: the model has no tokenizer, so text prompts is not available; copy "
                          "tokenizer.json and tokenizer_config.json from the original model")
    assert "no tokenizer.ggml.* metadata" in no_tokenizer_message("m.gguf", "chat")


def _word_tokenizer(directory, words: list[str]) -> None:
    """A tokenizer.json of ``len(words)`` whole-word tokens (far fewer than the model's 128 ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))


def test_tokenizer_smaller_than_the_model_vocabulary(tmp_path):
    save_random(transformers, FAMILIES["llama"](), tmp_path)
    words = ["<unk>", "<s>", "</s>", *"abcdefghijklm"]
    _word_tokenizer(tmp_path, words)
    llm = LLM(str(tmp_path), max_num_seqs=2)
    assert llm.tokenizer is not None and llm.tokenizer.vocab_size == 16 < llm.config.vocab_size == 128
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=0)
    out = llm.generate("a b c", params)[0].outputs[0]
    assert any(i >= 16 for i in out.token_ids)  # random weights sample past the tokenizer's ids
    assert out.text == llm.tokenizer.decode(out.token_ids)
    assert "".join(llm.stream("a b c", params)) == llm.tokenizer.decode(out.token_ids)
