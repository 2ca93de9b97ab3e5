"""RoPE tables grown with the positions used (``dtorch.models.rope_rows``): every row, after any sequence of growths,
is the row of the whole table built at once (torch's cos / sin of p * inv_freq, the attention factor on both), bit for
bit, for plain, Llama 3, YaRN (attention factor != 1) and Gemma 3's local base; a tiny Gemma 3 (two tables) fed a
prompt in chunks that cross the growth boundaries computes logits equal to those of a model whose tables were built
whole; a position past the loaded maximum is refused naming that maximum, not the rows held."""

from __future__ import annotations

import pytest
import torch

from dtorch.core.errors import ModelError
from dtorch.models import rope_rows
from dtorch.models.config import PRESETS, ModelConfig, rope_attention_factor, rope_inv_freq
from dtorch.models.rope_rows import RopeRows

transformers = pytest.importorskip("transformers")


def _whole(config: ModelConfig, local: bool, positions: int) -> torch.Tensor:
    """The table as it was built before it grew: all ``positions`` rows at once."""
    inv_freq = rope_inv_freq(config, local, positions)
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq
    scale = 1.0 if local else rope_attention_factor(config)
    return torch.stack([angles.cos(), angles.sin()], 1) * scale


def _configs() -> dict[str, tuple[ModelConfig, int]]:
    yarn = transformers.Qwen2Config(vocab_size=256, hidden_size=1024, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=8, num_key_value_heads=8, rope_theta=1e6,
                                    max_position_embeddings=65536,
                                    rope_scaling={"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3,
                                                  "truncate": False, "original_max_position_embeddings": 32768})
    # Gemma 3 270M's shape of RoPE: head 256 (128 frequencies), global base 1e6, local 1e4, 32k context
    gemma = ModelConfig("gemma3", vocab_size=256, hidden_size=640, intermediate_size=128, num_layers=1, num_heads=4,
                        num_kv_heads=1, head_dim=256, rope_theta=1e6, rope_local_theta=1e4,
                        max_position_embeddings=32768)
    return {"tiny-llama3": (PRESETS["tiny-llama3"], 5000), "yarn-attention-factor":
            (ModelConfig.from_hf(yarn.to_dict()), 40000), "gemma3-270m": (gemma, 32768)}


@pytest.mark.parametrize("name", ["tiny-llama3", "yarn-attention-factor", "gemma3-270m"])
def test_grown_rows_equal_the_whole_table(name):
    config, positions = _configs()[name]
    for local in (False, True) if config.rope_local_theta is not None else (False,):
        whole = _whole(config, local, positions)
        scale = 1.0 if local else rope_attention_factor(config)
        rows = RopeRows(rope_inv_freq(config, local, positions), scale, positions, first=100)
        assert rows.rows == 100 and torch.equal(rows.table, whole[:100])
        grown = [rows.rows]
        for top in (99, 100, 150, 1023, 1700, positions - 1, positions - 1):
            old = rows.table
            got = rows.reach(top)
            assert got is rows.table and rows.rows > top and torch.equal(got, whole[:rows.rows])
            if rows.rows != grown[-1]:
                grown.append(rows.rows)
                assert torch.equal(old, whole[:old.shape[0]])  # replaced, not written over
        assert grown == [100, 200, 1600, 3200, positions], grown  # doubling, capped at the positions


def test_a_table_starts_at_FIRST_rows_or_the_positions():
    config = PRESETS["tiny-llama"]
    inv_freq = rope_inv_freq(config, False, 50000)
    assert RopeRows(inv_freq, 1.0, 50000).rows == rope_rows.FIRST == 4096
    assert RopeRows(inv_freq, 1.0, 300).rows == 300


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from tests.tiny_models import save_random, tiny_config

    config = tiny_config(transformers, "gemma3", max_position_embeddings=256, pad_token_id=0)
    path = tmp_path_factory.mktemp("gemma3")
    save_random(transformers, config, path)
    return str(path)


def _chunked_logits(llm, prompt: list[int], cuts: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """Every row's logits of ``prompt`` fed as chunks ending at ``cuts`` (one sequence, blocks 0..); the global
    table's rows after each chunk."""
    from dtorch.models.executor import StepPlan

    ex = llm.executor
    bs = ex.cache.block_size
    blocks = list(range(-(-len(prompt) // bs)))
    out, rows, start = [], [], 0
    for end in cuts:
        plan = StepPlan(prompt[start:end], [end - start], [start], [blocks[:-(-end // bs)]])
        out.append(ex.step(plan, all_logits=True).clone())
        rows.append(llm.model.rope_table.shape[0])
        start = end
    return out, rows


def test_a_prompt_across_growths_gives_the_logits_of_whole_tables(gemma3, monkeypatch):
    from dtorch.engine.llm import LLM

    prompt = torch.randint(3, 128, (250,), generator=torch.Generator().manual_seed(5)).tolist()
    cuts = [5, 8, 9, 20, 70, 71, 130, 250]  # decodes and chunks across the rows 8, 16, 32, 64, 128, 256
    logits, rows = {}, {}
    for first in (8, 10 ** 9):
        monkeypatch.setattr(rope_rows, "FIRST", first)
        llm = LLM(gemma3, max_num_seqs=1, max_model_len=256)
        try:
            assert llm.model.rope_local_table is not None  # Gemma 3: the sliding layers' own table grows too
            logits[first], rows[first] = _chunked_logits(llm, prompt, cuts)
            assert llm.model.rope_local_table.shape[0] == rows[first][-1]
            if first > 256:  # the reference: tables built whole, as they were before they grew
                assert torch.equal(llm.model.rope_table, _whole(llm.config, False, 256))
                assert torch.equal(llm.model.rope_local_table, _whole(llm.config, True, 256))
        finally:
            llm.close()
    assert rows[8] == [8, 8, 16, 32, 128, 128, 256, 256] and rows[10 ** 9] == [256] * len(cuts)
    for got, want in zip(logits[8], logits[10 ** 9], strict=True):
        assert torch.equal(got, want)


def test_a_position_past_the_loaded_maximum_names_the_maximum(gemma3, monkeypatch):
    from dtorch.engine.llm import LLM
    from dtorch.models.executor import StepPlan

    monkeypatch.setattr(rope_rows, "FIRST", 16)
    llm = LLM(gemma3, max_num_seqs=1, max_model_len=64)
    try:
        ex = llm.executor
        assert llm.model.rope_table.shape[0] == 16 and llm.model.rope_positions == 64
        with pytest.raises(ModelError, match="position 64 is past the 64 positions the model was loaded for"):
            ex.feeds(StepPlan([7], [1], [64], [[0] * 5]), _bucket(1, 1))
        assert llm.model.rope_table.shape[0] == 16  # a refused step grows nothing
        ex.feeds(StepPlan([7], [1], [63], [[0] * 4]), _bucket(1, 1))
        assert llm.model.rope_table.shape[0] == 64
    finally:
        llm.close()


def _bucket(t: int, n: int):
    from dtorch.models.bucket import bucket_for

    return bucket_for(t, n)


def test_feeds_written_into_runner_buffers_follow_a_grown_table(gemma3, monkeypatch):
    """The numpy-written feeds (``Executor.feeds(into=...)``) read the tables as they are after a growth, and the
    executor lets the old tables go (its numpy views are per table, not per tensor ever made)."""
    import gc
    import weakref

    from dtorch.engine.llm import LLM
    from dtorch.models.bucket import bucket_for
    from dtorch.models.executor import StepPlan

    monkeypatch.setattr(rope_rows, "FIRST", 16)
    llm = LLM(gemma3, max_num_seqs=1, max_model_len=256)
    try:
        ex, model = llm.executor, llm.model
        into = ex.runner(bucket_for(1, 1)).feed_buffers()
        whole = {"cos": _whole(llm.config, False, 256)[:, 0], "cos_local": _whole(llm.config, True, 256)[:, 0],
                 "sin": _whole(llm.config, False, 256)[:, 1], "sin_local": _whole(llm.config, True, 256)[:, 1]}
        olds = []
        for pos in (5, 100, 101, 200):  # rows 16, 128, 128, 256
            olds += [weakref.ref(model.rope_table), weakref.ref(model.rope_local_table)]
            fed = ex.feeds(StepPlan([7], [1], [pos], [list(range(pos // ex.cache.block_size + 1))]),
                           bucket_for(1, 1), into)
            assert set(whole) <= set(fed)
            for name, rows in whole.items():
                assert fed[name] is into[name][0] and torch.equal(fed[name], rows[pos:pos + 1]), (pos, name)
        assert model.rope_table.shape[0] == 256
        gc.collect()
        assert all(r() is None for r in olds), "a table replaced by a growth is still held"
    finally:
        llm.close()

