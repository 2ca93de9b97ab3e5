"""A model family is one declaration (``dtorch.models.families``): every family's tensor table against transformers'
own parameter names and shapes and against gguf-py's llama.cpp tensor names (the names its converter writes); a
Llama-like family declared outside dtorch and registered loads a checkpoint, from its directory and from a GGUF, and
runs it as transformers does; a GGUF tensor no table names is refused."""

from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path

import numpy as np
import pytest
import torch

import dtorch
from dtorch.engine.llm import LLM
from dtorch.engine.sampling import SamplingParams
from dtorch.models import families
from dtorch.models.config import ModelConfig
from dtorch.models.families import Family
from dtorch.models.tiny import tiny_models, write_gguf
from tests.tiny_models import hf_greedy, save_random, tiny_config

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

FAMILIES = tuple(tiny_models())  # every family's tiny models by model_type (llama's module has mistral's too)
# where llama.cpp's converter renames a tensor before its name map (``convert_hf_to_gguf.py``): dt_bias is mapped as
# dt_proj.bias; Qwen3-Next's in_proj_qkvz is split into attn_qkv and attn_gate (the table names both)
_RENAMED = {"linear_attn.dt_bias": "linear_attn.dt_proj.bias"}


def _config(family: str):
    return tiny_config(transformers, family, **({"mlp_only_layers": [1]} if family == "qwen3_moe" else {}))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tensor_table_names_what_transformers_holds(family):
    cfg = _config(family)
    table = families.sources(ModelConfig.from_hf(cfg.to_dict()))
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg)
    theirs = {n: tuple(p.shape) for n, p in hf.state_dict().items()}
    if cfg.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    ours = {n: s.shape for n, s in table.items()}
    for name in [n for n in ours if n.endswith("mlp.experts.gate_proj")]:  # transformers 5 fuses [E, 2I, H]
        gate, up = ours.pop(name), ours.pop(name.replace("gate_proj", "up_proj"))
        ours[name.replace("gate_proj", "gate_up_proj")] = (gate[0], gate[1] + up[1], gate[2])
    assert ours == theirs


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "mistral"])  # llama.cpp converts Mistral to llama
def test_the_tensor_table_names_what_llama_cpp_writes(family):
    c = ModelConfig.from_hf(_config(family).to_dict())
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == families.get(family).gguf_arch)
    names = gguf.get_tensor_name_map(arch, c.num_layers)
    dense = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_layers)  # qwen3moe's map has no dense MLP
    for hf, source in families.sources(c).items():
        if hf.endswith("in_proj_qkvz.weight"):
            i = hf.split(".")[2]
            assert source.gguf == (f"blk.{i}.attn_qkv.weight", f"blk.{i}.attn_gate.weight")
            continue
        for old, new in _RENAMED.items():
            hf = hf.replace(old, new)
        if hf.endswith((".weight", ".bias")):
            base, suffix = hf.rsplit(".", 1)
        else:  # A_log has no suffix; experts the loaders stack (no .weight) the converter stacks as .weight
            base, suffix = hf, "weight" if ".mlp.experts." in hf else None
        want = names.get_name(base) or dense.get_name(base)
        assert source.gguf == (f"{want}.{suffix}" if suffix else want,), hf


def test_every_module_with_a_family_is_registered():
    modules = [importlib.import_module(f"dtorch.models.families.{m.name}")
               for m in pkgutil.iter_modules(families.__path__)]
    declared = [m.FAMILY for m in modules if hasattr(m, "FAMILY")]
    assert all(families.get(f.name) is f for f in declared)
    assert sorted(f.name for f in declared) == sorted(families.names())
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    for f in declared:  # each a tiny model, which the tests above and the family's own test run, and a README row
        assert f.tiny, f"family {f.name} declares no tiny model: give it Family(tiny={{model_type: (config class, " \
                       "fields)}}) in its module"
        assert f"| {f.name} |" in readme or f"| {f.name} / " in readme or f" / {f.name} |" in readme, \
            f"family {f.name} has no row in the README's family table: add '| {f.name} | ... |' under Model families"
    with pytest.raises(dtorch.ModelError, match=r"claims what another family has: model_type 'qwen2' \(qwen2\)"):
        families.register(Family(name="other", hf_types=("qwen2",)))
    with pytest.raises(dtorch.ModelError, match="no model family 'gpt2'; known: "):
        families.get("gpt2")


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """A Qwen2-like family declared here (its q/k/v biases, its own model_type and GGUF architecture) and a tiny
    random Qwen2 checkpoint saved under its name, as a directory and as a GGUF file; (transformers model, path)."""
    if families.by_hf_type("outside_qwen") is None:
        families.register(Family(name="outside_qwen", hf_types=("outside_qwen",), gguf_arch="outside_qwen",
                                 fields={"attention_bias": True},  # Qwen2's sliding-window keys, inert when off
                                 hf_inert=families.get("qwen2").hf_inert))
    path = tmp_path_factory.mktemp("outside")
    hf = save_random(transformers, tiny_config(transformers, "qwen2"), path)
    write_gguf(hf, path / "model.gguf", arch="outside_qwen")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"model_type": "outside_qwen"}))
    return hf, path


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_a_family_declared_outside_loads_and_runs_as_transformers(outside, source):
    hf, path = outside
    llm = LLM(str(path / "model.gguf" if source == "gguf" else path), max_num_seqs=2)
    try:
        assert llm.config.family == "outside_qwen" and llm.config.attention_bias
        ids = torch.randint(3, 128, (20,), generator=torch.Generator().manual_seed(1)).tolist()
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(llm.logits(ids), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 8)
    finally:
        llm.close()


def test_a_gguf_tensor_no_table_names_is_refused(outside, tmp_path):
    hf, _ = outside
    extra = {"blk.0.attn_output.bias": (np.zeros(64, np.float32), gguf.GGMLQuantizationType.F32)}
    write_gguf(hf, tmp_path / "m.gguf", arch="outside_qwen", extra=extra)
    with pytest.raises(dtorch.ModelError, match=r"unexpected tensors \['blk.0.attn_output.bias'\]"):
        LLM(str(tmp_path / "m.gguf"))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_config_key_no_family_reads_is_refused(family):
    """Every key transformers writes for a tiny model of each family loads; a quantization or Granite's multipliers on
    a family that does not read them is refused naming the key (it would otherwise run silently wrong)."""
    config = _config(family).to_dict()
    ModelConfig.from_hf(config)
    for key, value in (("quantization_config", {"quant_method": "fp8"}), ("residual_multiplier", 0.22)):
        if key not in config:
            with pytest.raises(dtorch.ModelError, match=f"models do not read \\['{key}'\\]"):
                ModelConfig.from_hf(config | {key: value})
    with pytest.raises(dtorch.ModelError, match=r"use_sliding_window=True is not supported|use_sliding_window"):
        ModelConfig.from_hf(config | {"use_sliding_window": True})


def test_a_field_name_nothing_checks_is_refused():
    from dtorch.models.config_fields import check_field

    with pytest.raises(dtorch.ModelError, match="check_field: no field 'num_layer'"):
        check_field("num_layer", 4, "config.json: num_hidden_layers")  # a typo would check nothing
    with pytest.raises(dtorch.ModelError, match=r"hf_keys / gguf_keys name \['residual_scale'\]"):
        Family(name="typo", hf_types=("typo",), hf_keys={"residual_scale": "residual_multiplier"})


def test_the_shared_skeleton_names_no_family():
    """``models/model.py`` builds every family's graph from ``ModelConfig`` fields: it names no family (its name, its
    model types, its GGUF architecture) and never reads ``config.family``; a difference goes through a field."""
    import re

    source = (Path(__file__).parent.parent / "dtorch" / "models" / "model.py").read_text().lower()
    source = source.replace("llama.cpp", "")  # the project, not the family
    for name in families.names():
        f = families.get(name)
        for word in {f.name, *f.hf_types, *f.hf_multimodal, *([f.gguf_arch] if f.gguf_arch else [])}:
            assert not re.search(rf"\b{re.escape(word.lower())}\b", source), \
                f"models/model.py names {word!r} (family {f.name}): give the difference a ModelConfig field instead " \
                "(docs/adding-a-family.md, step 3)"
    assert ".family" not in source, "models/model.py reads config.family: branch on a ModelConfig field instead"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_default_rope_base_is_transformers(family):
    """A config.json without a RoPE base gets the family's ``hf_rope_theta``: transformers' ``default_theta`` of the
    family's config class (Gemma 3's global one; its sliding layers' is rope_local_base_freq's default)."""
    cls = getattr(transformers, tiny_models()[family][0])
    want = cls.default_theta["global"] if isinstance(cls.default_theta, dict) else cls.default_theta
    assert families.by_hf_type(family).hf_rope_theta == want
