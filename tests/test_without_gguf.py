"""dtorch needs the ``gguf`` package only to read a GGUF file: ops, graphs and Hugging Face checkpoints run without
it (the GPU machine's image has no ``gguf``), and a GGUF file read without it is a ModelError that says what to
install. Run in a subprocess whose import system refuses ``gguf``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import transformers

from dtorch.models.tiny import families, hf_greedy, save_random, write_gguf

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import importlib.abc
    import json
    import sys

    class NoGguf(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "gguf" or name.startswith("gguf."):
                raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
            return None

    sys.meta_path.insert(0, NoGguf())
    import torch

    import dtorch

    args = json.loads(sys.argv[1])
    torch.manual_seed(0)
    x, w = torch.randn(3, 64), torch.randn(64)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(dtorch.ops.rms_norm(x, w, 1e-6), want)
    print("ops ok", flush=True)

    w1, w2, xs = torch.randn(16, 24), torch.randn(24, 16), torch.randn(4, 16)
    g = dtorch.LogicalGraph(dtorch.DeviceMesh.cpu(2))
    y = (g.input("x", (4, 16)) @ g.param("w1", w1, dtorch.Shard(1))).relu() @ g.param("w2", w2, dtorch.Shard(0))
    g.output("y", g.redistribute(y, dtorch.Replicate()))
    with dtorch.Runner(g) as r:
        torch.testing.assert_close(r.run({"x": xs})["y"], torch.relu(xs @ w1) @ w2, rtol=1e-5, atol=1e-5)
    print("graph ok", flush=True)

    llm = dtorch.LLM(args["hf"], threads=1, max_num_seqs=2)
    try:
        out = llm.generate([args["prompt"]], dtorch.SamplingParams(temperature=0.0, max_tokens=len(args["want"]),
                                                                   ignore_eos=True))
    finally:
        llm.close()
    assert out[0].outputs[0].token_ids == args["want"], (out[0].outputs[0].token_ids, args["want"])
    print("hf checkpoint ok", flush=True)

    try:
        dtorch.LLM(args["gguf"], threads=1)
    except dtorch.ModelError as e:
        assert "gguf" in str(e) and "pip install" in str(e), e
    else:
        raise AssertionError("a GGUF file was read without the gguf package")
    assert "gguf" not in sys.modules, "gguf was imported"
    print("gguf file: ModelError ok", flush=True)
""")


def test_ops_graphs_and_hf_checkpoints_run_without_gguf(tmp_path):
    cfg = families(transformers, heads=4, kv_heads=2, vocab=128, qwen3_head_dim=16)["llama"]()
    hf = save_random(transformers, cfg, tmp_path / "hf")
    write_gguf(hf, tmp_path / "m.gguf")
    prompt = [1, 5, 9, 14]
    args = {"hf": str(tmp_path / "hf"), "gguf": str(tmp_path / "m.gguf"), "prompt": prompt,
            "want": hf_greedy(hf, prompt, 4)}
    p = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(args)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, f"without gguf:\n{p.stdout}\n{p.stderr[-3000:]}"
