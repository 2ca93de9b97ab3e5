"""Mistral with a sliding window shorter than its prompts, Gemma 3 (text) and Phi-3 against transformers: tiny random
checkpoints written by transformers, loaded from their directories and from GGUF files written with llama.cpp's tensor
names (gguf-py); logits of prompts past the window, greedy ids alone and in a batch, one device and two. Then the
paged cache of a model whose layers all slide: a long generation holds only its window of blocks."""

from __future__ import annotations

import pytest
import torch

from dtorch.engine.llm import LLM
from dtorch.engine.sampling import SamplingParams
from dtorch.models.tiny import write_gguf
from tests.tiny_models import hf_greedy, save_random, tiny_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

VOCAB = 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# the tiny configs' windows (Mistral 16, Gemma 3's local layers 8, Phi-3 12) are shorter than the prompts (to 53)
FAMILIES = {family: (lambda family=family: tiny_config(transformers, family, max_position_embeddings=256,
                                                       pad_token_id=0)) for family in ("mistral", "gemma3", "phi3")}


def _prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


PROMPTS = [_prompt(9, seed=2), _prompt(40, seed=3), _prompt(23, seed=4)]  # shorter and longer than the windows


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request, tmp_path_factory):
    """(family, transformers model, checkpoint directory, its GGUF file, greedy ids of PROMPTS by transformers)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random(transformers, FAMILIES[request.param](), path)
    gguf_path = path / "model.gguf"
    write_gguf(hf, gguf_path)
    want = [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    return request.param, hf, path, gguf_path, want


@pytest.mark.parametrize("source", ["hf", "gguf", "hf_tp2"])
def test_logits_and_greedy_ids_match_transformers(model, source):
    family, hf, path, gguf_path, want = model
    llm = LLM(str(gguf_path if source == "gguf" else path), max_num_seqs=4,
              tensor_parallel_size=2 if source == "hf_tp2" else 1)
    try:
        ids = _prompt(53)
        with torch.no_grad():
            _close(llm.logits(ids), hf(torch.tensor([ids])).logits[0])
        assert [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS[:2]] == want[:2]
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    finally:
        llm.close()


def test_the_config_is_transformers(model):
    family, hf, path, gguf_path, _ = model
    for source in (path / "config.json", gguf_path):
        from dtorch.models.loaders import open_checkpoint

        with open_checkpoint(source.parent if source.name == "config.json" else source) as ckpt:
            c = ckpt.config
        windows = [c.window(i) for i in range(c.num_layers)]
        if family == "gemma3":
            assert c.family == "gemma3" and windows == [8] * 5 + [None] and c.kv_window is None
            assert c.rope_local_theta == 1e4 and c.rope_theta == 1e6 and c.rope_scaling["factor"] == 2.0
            assert c.attn_scale == pytest.approx(24 ** -0.5) and c.embedding_multiplier == pytest.approx(8.0)
            assert c.norm_placement == "sandwich"
            assert c.hidden_act == "gelu_tanh" and c.norm_plus_one and c.qk_norm and c.tie_word_embeddings
        else:
            window = hf.config.sliding_window
            assert windows == [window] * c.num_layers and c.kv_window == window
        if family == "phi3":
            assert c.rotary_dim == 12 and c.head_dim == 16


def test_a_long_generation_holds_only_its_window(model, tmp_path):
    """Every Mistral / Phi-3 layer slides: blocks that left the window go back to the pool as the sequence grows,
    and what it generates is still transformers' greedy continuation. Gemma 3's global layer reads every key: none
    is freed."""
    family, hf, path, _, _ = model
    bs = 4
    llm = LLM(str(path), max_num_seqs=2, block_size=bs, enable_prefix_caching=False)
    try:
        prompt, new = _prompt(30, seed=5), 40
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        engine, got, held = llm.engine, [], []
        engine.add_request("r", prompt, params, got.append)
        while engine.has_unfinished():
            engine.step()
            held.append(engine.blocks.num_used)
        ids = [t for d in got for t in d.token_ids]
        assert ids == hf_greedy(hf, prompt, new)
        # blocks held after the step before the last: prompt + new - 2 keys (the last step's are freed within it)
        total = -(-(len(prompt) + new - 2) // bs)
        window = llm.config.kv_window
        if window is None:
            assert max(held) == total  # every block kept to the end
        else:
            # the window of the next token, the block the next token goes to, and one partly outside the window
            assert max(held[-5:]) <= window // bs + 2 < total
        assert engine.blocks.num_used == 0  # and all of them back when it finished
    finally:
        llm.close()


def test_the_text_model_of_a_multimodal_gemma3_checkpoint(tmp_path):
    """A ``gemma3`` checkpoint (Gemma3ForConditionalGeneration): its text_config and language model tensors load, the
    vision tower and projector are left out, and a text prompt's logits are the multimodal model's."""
    text = FAMILIES["gemma3"]().to_dict()
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14).to_dict()
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3,
                                       eoi_token_index=VOCAB - 2)
    hf = save_random(transformers, config, tmp_path)
    llm = LLM(str(tmp_path), max_num_seqs=2)
    try:
        assert llm.config.family == "gemma3" and llm.config.kv_window is None
        ids = _prompt(30, seed=6)
        with torch.no_grad():
            _close(llm.logits(ids), hf(torch.tensor([ids])).logits[0])
    finally:
        llm.close()


def test_variants_it_does_not_run_are_named():
    import dtorch
    from dtorch.models.config import ModelConfig

    gemma = FAMILIES["gemma3"]().to_dict()
    with pytest.raises(dtorch.ModelError, match="final_logit_softcapping=30.0 is not supported"):
        ModelConfig.from_hf(gemma | {"final_logit_softcapping": 30.0})
    with pytest.raises(dtorch.ModelError, match="hidden_activation='silu' is not supported"):
        ModelConfig.from_hf(gemma | {"hidden_activation": "silu"})
    phi = FAMILIES["phi3"]().to_dict()
    dynamic = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(dtorch.ModelError, match="rope_scaling type 'dynamic' is not supported"):
        ModelConfig.from_hf(phi | {"rope_parameters": dynamic})
    with pytest.raises(dtorch.ModelError, match="sliding_window must be an int >= 1"):
        ModelConfig.from_hf(phi | {"sliding_window": 0})
