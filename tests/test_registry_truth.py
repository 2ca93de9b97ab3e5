"""The registry tells the truth: registration order does not matter, what ``explain`` calls active is what a
prepared operator binds, keys and settings are checked at the door, and a backend that cannot load says why."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import dtorch
from dtorch import ops
from dtorch.core import cpu
from dtorch.core.device import Device
from dtorch.dispatch import Call, Dispatcher, KernelKey, PreparedKernel
from dtorch.dispatch.registration import KernelSet
from dtorch.kernels import Backend
from dtorch.kernels.torch.matmul import native_bf16_matmul

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DTORCH_")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**clean, "PYTHONPATH": str(ROOT), **env}, cwd=ROOT)


def _wrong_rms_norm(ctx, inputs, outputs):
    x, w = inputs
    torch.mul(x, w, out=outputs[0])  # forgets to normalize


# -- registration order --------------------------------------------------------------------------

def test_readme_snippet_works_first_thing_in_a_fresh_interpreter():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Kernels"):]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    done = _python(snippet)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    explained = out[:out.index("\n\n")] if "\n\n" in out else out
    assert re.search(r"\* user .*\[active\]", explained), out
    assert re.search(r"torch .*lower priority than user", explained), out
    assert re.search(r"reference .*lower priority than user", explained), out
    assert re.search(r"inside disabled\('user'\): (native|torch)", out), out  # falls back to a built-in
    assert "verify: ok" in out, out


def test_verify_catches_a_lying_kernel_registered_before_the_backends_load():
    """#14: a user kernel registered first thing in a fresh process (before any backend has loaded) is still compared
    with the reference under verify()."""
    done = _python("""
import torch, dtorch
from dtorch import KernelKey
def liar(ctx, inputs, outputs):
    outputs[0].copy_(inputs[0] * 2)  # not an RMS norm
dtorch.dispatcher.register(KernelKey("llm.rms_norm", "cpu", torch.float32), liar, provider="user")
try:
    with dtorch.verify():
        dtorch.ops.rms_norm(torch.randn(4, 64), torch.randn(64), 1e-6)
    print("passed silently")
except dtorch.VerifyError as e:
    print("VerifyError:", e)
""")
    assert done.returncode == 0, done.stderr
    assert "VerifyError: verify llm.rms_norm/cpu/float32: output 0 of user" in done.stdout, done.stdout


@pytest.mark.parametrize("when", ["before any lookup", "after a lookup"])
def test_a_user_kernel_stands_beside_the_builtins(when):
    lookup = "dtorch.ops.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6)\n" if when == "after a lookup" else ""
    code = f"""
import torch, dtorch
from dtorch import KernelKey
{lookup}
def wrong(ctx, inputs, outputs):
    torch.mul(inputs[0], inputs[1], out=outputs[0])
key = KernelKey("llm.rms_norm", "cpu", torch.float32)
dtorch.dispatcher.register(key, wrong, provider="user")
print(sorted(c.provider for c in dtorch.dispatcher.candidates(key)))
x, w = torch.randn(2, 8), torch.ones(8)
with dtorch.dispatcher.disabled("user"):
    got = dtorch.ops.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got, torch.nn.functional.rms_norm(x, (8,), w, 1e-6))
    print("fallback", dtorch.dispatcher.select(key).provider)
try:
    with dtorch.verify():
        dtorch.ops.rms_norm(x, w, 1e-6)
except dtorch.VerifyError as exc:
    print("verify caught:", exc)
"""
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert re.search(r"\['reference', 'torch', 'user'\]|\['native', 'reference', 'torch', 'user'\]", done.stdout)
    assert re.search(r"fallback (native|torch)", done.stdout)
    assert "verify caught: verify llm.rms_norm/cpu/float32: output 0 of user" in done.stdout


def test_a_registration_during_the_backend_load_waits_for_it_and_keeps_both():
    loading, release = threading.Event(), threading.Event()
    builtins = KernelSet(devices=("cpu",))

    def builtin(ctx, inputs, outputs):
        outputs[0].copy_(inputs[0])
    builtins.add("slow.op", builtin, (torch.float32,))

    def loader(disp: Dispatcher, device_type: str) -> None:
        loading.set()
        release.wait(5)
        builtins.install(disp, device_type)

    d = Dispatcher(backends={"cpu": loader})
    key = KernelKey("slow.op", "cpu", torch.float32)
    lookup = threading.Thread(target=lambda: d.select(key))
    lookup.start()
    assert loading.wait(5)
    user_done = []
    user = threading.Thread(target=lambda: user_done.append(d.register(key, _wrong_rms_norm, provider="user")))
    user.start()
    time.sleep(0.05)
    assert not user_done  # it waits for the load, which defines the op
    release.set()
    lookup.join(5)
    user.join(5)
    assert [c.provider for c in d.candidates(key)] == ["user", "reference"]


# -- what is reported active is what runs --------------------------------------------------------

def _prepared_builders():
    """(op, build) for every prepared operator class: build() -> an unprepared operator."""
    return [
        ("matmul.mm", lambda: ops.MatMul()),
        ("matmul.bmm", lambda: ops.MatMul(batched=True)),
        ("matmul.linear", lambda: ops.Linear(has_bias=False)),
        ("llm.rms_norm", lambda: ops.RMSNorm()),
        ("llm.add_rms_norm", lambda: ops.AddRMSNorm()),
        ("llm.silu_and_mul", lambda: ops.SiluAndMul()),
        ("llm.embedding", lambda: ops.Embedding()),
        ("llm.rope", lambda: ops.RoPE(head_dim=64)),
        ("llm.flash_attention", lambda: ops.Attention(True, None, 4, 2, 64)),
        ("llm.flash_attention_varlen", lambda: ops.AttentionVarlen(True, None, 4, 2, 64)),
        ("llm.gated_delta_net", lambda: ops.GatedDeltaNet()),
        ("llm.causal_conv1d", lambda: ops.CausalConv1d()),
        ("binary.add", lambda: ops.Binary("add")),
    ]


@pytest.mark.parametrize("bf16_units", [True, False], ids=["bf16-units", "no-bf16-units"])
def test_explain_reports_what_prepared_operators_bind(bf16_units):
    with cpu.forced(avx512_bf16=bf16_units, amx_bf16=False):
        assert native_bf16_matmul() is bf16_units
        keys = dtorch.dispatcher.keys("cpu")
        assert len(keys) > 100
        for key in keys:
            bound = PreparedKernel(dtorch.dispatcher, key, Call(Device("cpu"), key.dtype))
            assert bound.provider == dtorch.dispatcher.explain(key).winner.provider, str(key)
        checked = 0
        for op, build in _prepared_builders():
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                key = KernelKey(op, "cpu", dtype)
                if not dtorch.dispatcher.candidates(key):
                    continue
                prepared = build().prepare(dtorch.OperatorInitContext("cpu", dtype))
                assert prepared.provider == dtorch.dispatcher.explain(key).winner.provider, str(key)
                checked += 1
        assert checked >= 30
        mm = dtorch.dispatcher.explain(KernelKey("matmul.mm", "cpu", torch.bfloat16))
        assert mm.winner.provider == ("blas" if bf16_units else "upcast"), str(mm)


def test_forcing_the_probe_rebinds_live_prepared_operators():
    mm = ops.MatMul().prepare(dtorch.OperatorInitContext("cpu", torch.bfloat16))
    a, b = torch.randn(32, 64).bfloat16(), torch.randn(64, 48).bfloat16()
    want = (a.float() @ b.float())
    with cpu.forced(avx512_bf16=True):
        assert mm.provider == "blas"
        torch.testing.assert_close(mm.forward(a, b).float(), want, rtol=2e-2, atol=2e-1)
    with cpu.forced(avx512_bf16=False, amx_bf16=False):
        assert mm.provider == "upcast"
        torch.testing.assert_close(mm.forward(a, b).float(), want, rtol=2e-2, atol=2e-1)


def test_a_shape_dependent_winner_says_so():
    with cpu.forced(avx512_bf16=False, amx_bf16=False):
        exp = dtorch.dispatcher.explain(KernelKey("matmul.mm", "cpu", torch.bfloat16))
        assert "varies: torch's bf16 mm below 16 rows" in str(exp)
        rows = [r for r in dtorch.dispatcher.table("cpu") if r.key.op == "matmul.mm" and r.active
                and r.key.dtype == torch.bfloat16]
        assert rows[0].provider == "upcast" and "below 16 rows" in rows[0].varies
        few = Call(Device("cpu"), torch.bfloat16, inputs=(torch.empty(4, 64, device="meta"),
                                                           torch.empty(64, 48, device="meta")))
        assert dtorch.dispatcher.choose(KernelKey("matmul.mm", "cpu", torch.bfloat16), few).winner.provider == "blas"


# -- keys and settings at the door -------------------------------------------------------------

@pytest.mark.parametrize(("key", "message"), [
    (KernelKey("llm.rms_norm", "cpu", "float32"), "dtype must be a torch.dtype"),
    (KernelKey("llm.rms_norm", "CPU", torch.float32), "device type must be one of cpu, cuda, meta"),
    (KernelKey("llm.rms_nrom", "cpu", torch.float32), "op 'llm.rms_nrom' is not defined"),
    (KernelKey("rms_norm.llm", "cpu", torch.float32), "dispatcher.define"),
    (KernelKey("llm.rms_norm", "cpu", torch.float32, "sparse_coo"), "layout 'sparse_coo' has no kernels"),
])
def test_keys_that_can_never_match_are_refused(key, message):
    with pytest.raises(dtorch.RegistrationError, match=re.escape(message)):
        dtorch.dispatcher.register(key, _wrong_rms_norm, provider="user")
    assert all(c.provider != "user" for c in dtorch.dispatcher.candidates(KernelKey("llm.rms_norm", "cpu",
                                                                                       torch.float32)))


def test_a_new_op_is_defined_first():
    d = Dispatcher(backends={})
    key = KernelKey("myfamily.op", "cpu", torch.float32)
    with pytest.raises(dtorch.RegistrationError, match=r"dispatcher.define\('myfamily.op'\)"):
        d.register(key, _wrong_rms_norm, provider="reference")
    d.define("myfamily.op")
    d.register(key, _wrong_rms_norm, provider="reference")
    assert d.select(key).fn is _wrong_rms_norm
    with pytest.raises(dtorch.RegistrationError, match="family.name"):
        d.define("noseparator")


@pytest.mark.parametrize(("env", "message"), [
    ({"DTORCH_DISABLE_PROVIDERS": "blass"}, "unknown provider(s) blass; known: blas"),
    ({"DTORCH_THREADS": "abc"}, "DTORCH_THREADS='abc' is not valid; expected an int >= 0"),
    ({"DTORCH_THREADS": "-2"}, "DTORCH_THREADS='-2' is not valid"),
    ({"DTORCH_SYNC_TIMEOUT": "0"}, "DTORCH_SYNC_TIMEOUT='0' is not valid; expected a finite number of seconds > 0"),
    ({"DTORCH_VERIFY": "maybe"}, "DTORCH_VERIFY='maybe' is not a flag"),
    ({"DTORCH_TRACE": "2"}, "DTORCH_TRACE='2' is not a flag"),
    ({"DTORCH_ONE_LEVEL": "2"}, "DTORCH_ONE_LEVEL='2' is not a flag"),
    ({"DTORCH_NATIVE_ISA": "sse"}, "expected one of auto, avx512, avx2, portable"),
    ({"DTORCH_CPU_FEATURES": "-avx512_bf17"}, "unknown CPU feature 'avx512_bf17'"),
    ({"DTORCH_CPU_FEATURES": "avx2"}, "must be +name or -name"),
    ({"DTORCH_THRADS": "1"}, "unknown environment setting(s) DTORCH_THRADS; dtorch reads"),
])
def test_malformed_settings_fail_at_import_listing_what_is_allowed(env, message):
    done = _python("import dtorch", **env)
    assert done.returncode != 0
    assert "ConfigError" in done.stderr and message in done.stderr, done.stderr


def test_well_formed_settings_are_read():
    done = _python("import dtorch; from dtorch.core import env, cpu; "
                   "print(env.threads(), env.sync_timeout(), env.verify(), sorted(env.disabled_providers()),"
                   " cpu.has('avx2'))",
                   DTORCH_THREADS="3", DTORCH_SYNC_TIMEOUT="2.5", DTORCH_VERIFY="yes",
                   DTORCH_DISABLE_PROVIDERS="blas, sdpa", DTORCH_CPU_FEATURES="-avx2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3", "2.5", "True", "['blas',", "'sdpa']", "False"]


# -- backends say why they are missing ---------------------------------------------------------

def test_a_backend_that_cannot_load_registers_nothing_and_says_why(monkeypatch, capsys):
    import types

    import dtorch.cli
    import dtorch.dispatch
    import dtorch.kernels

    picky = types.ModuleType("dtorch_test_picky_backend")
    picky.unavailable = lambda device_type: "this CPU lacks the instructions it needs (test)"
    picky.install = lambda d, device_type: pytest.fail("an unavailable backend must not install")
    monkeypatch.setitem(sys.modules, "dtorch_test_picky_backend", picky)
    monkeypatch.setattr(dtorch.kernels, "BACKENDS", dtorch.kernels.BACKENDS + (
        Backend("picky", "dtorch_test_picky_backend", ("cpu",)),
        Backend("absent", "dtorch_test_no_such_backend", ("cpu",))))
    d = Dispatcher()
    exp = d.explain(KernelKey("matmul.mm", "cpu", torch.float32))
    assert exp.winner.provider in ("onednn", "blas")  # the torch backend still loaded (onednn where torch has it)
    text = str(exp)
    assert "backend 'picky' unavailable on cpu: this CPU lacks the instructions it needs (test)" in text
    assert "backend 'absent' unavailable on cpu: cannot import dtorch_test_no_such_backend" in text
    assert set(d.unavailable("cpu")) == {"picky", "absent"}
    monkeypatch.setattr(dtorch.dispatch, "dispatcher", d)
    assert dtorch.cli.main(["kernels"]) == 0
    out = capsys.readouterr().out
    assert "backend 'picky' unavailable on cpu: this CPU lacks" in out
    assert "backend 'absent' unavailable on cpu" in out


def test_the_cli_marks_shape_dependent_cells():
    done = _python("import dtorch.cli, sys; sys.exit(dtorch.cli.main(['kernels', '--op', 'matmul']))",
                   DTORCH_CPU_FEATURES="-avx512_bf16,-amx_bf16")
    assert done.returncode == 0, done.stderr
    assert re.search(r"matmul\.mm\s.*upcast\*", done.stdout), done.stdout
    assert "upcast* (matmul.mm): the path depends on the call: torch's bf16 mm below 16 rows" in done.stdout
