"""The native op list (csrc/ops.def, entries.def) drives the tables, the module and the registrations; the build
compiles one object per unit and group, keyed by its own inputs, and recompiles only what a change reaches: a
declared op never recompiles binding.cpp.

What is measured is which objects were compiled, never how long that took (bench/README.md has the times).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import dtorch.kernels.native as nk
from dtorch.core.errors import RegistrationError
from dtorch.dispatch.registration import KernelSet
from dtorch.kernels.native import build, oplist
from dtorch.kernels.native.kernels import KERNELS
from dtorch.kernels.native.objcache import CompileError, ObjectCache, Tree, Unit

CXX = build.compiler()
compiler = pytest.mark.skipif(shutil.which(CXX) is None, reason=f"no C++ compiler {CXX!r}")
_REASON = nk.unavailable_reason()
native = pytest.mark.skipif(_REASON is not None, reason=f"native kernels unavailable: {_REASON}")


def _copy(tmp_path: Path) -> Path:
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    return csrc


def _with_entry(tmp_path: Path, line: str) -> Path:
    """A copy of csrc whose entries.def lists ``line`` too (after the last entry)."""
    csrc = _copy(tmp_path)
    (csrc / "entries.def").write_text((csrc / "entries.def").read_text() + line + "\n")
    return csrc


# the toy op of docs/adding-an-op.md as a group of its own: out = x * w * scale, rows of [R, D] with w [D]
from bench.native_build import TOY_KERNEL, TOY_ROW  # noqa: E402 - the toy op of docs/adding-an-op.md, one copy


def _with_group(tmp_path: Path, rows: str, kernel: str | None = TOY_KERNEL, group: str = "toy",
                listed: bool = True) -> Path:
    """A copy of csrc with a group of its own: ops/<group>.def holding ``rows``, ops/<group>.h ``kernel``, and the
    group's line in ops.def (unless not ``listed``)."""
    csrc = _copy(tmp_path)
    (csrc / "ops" / f"{group}.def").write_text(rows + "\n")
    if kernel is not None:
        (csrc / "ops" / f"{group}.h").write_text(kernel)
    if listed:
        text = (csrc / "ops.def").read_text()
        last = '#include "ops/softmax.def"\n'
        (csrc / "ops.def").write_text(text.replace(last, last + f'#include "ops/{group}.def"\n', 1))
    return csrc


# -- the declaration drives everything -----------------------------------------------------------------------

@native
def test_module_functions_are_the_list_rows():
    """The compiled module has exactly the functions of ops.def's rows (DTN_ENTRY and DTN_OP), each with its doc;
    every kernel of the list is in every ISA table (else the module would not load: table.cpp refuses an incomplete
    table)."""
    mod = nk.load()
    ops = oplist.parse()
    assert ops.functions() == {n for n in dir(mod) if not n.startswith("_")}
    for e in (*ops.entries, *ops.row_ops):
        assert getattr(mod, e.name).__doc__ == e.doc
    for isa in nk.available_isas():  # every table the CPU runs is complete and selectable
        with nk.use_isa(isa):
            assert nk.isa() == isa


def test_every_row_has_its_registration_and_every_entry_op_its_kernel():
    """Each DTN_OP row is registered from the row (its op, cpu, float32 and bfloat16, native, its meta, its fallback
    importable); each op a DTN_ENTRY names has a hand-written native kernel, and no native kernel is unlisted."""
    ops = oplist.parse()
    assert ops.row_ops, "the list declares no op whole (DTN_OP): the declared path is untested"
    native_entries = [e for e in KERNELS.entries if e.provider == "native"]
    for row in ops.row_ops:
        mine = [e for e in native_entries if e.fn.__name__ == row.name and e.op == row.op]
        assert len(mine) == 1, row
        assert mine[0].dtypes == (torch.float32, torch.bfloat16) and mine[0].layout == "strided"
        assert (mine[0].meta is not None and mine[0].meta.inplace) == row.inplace
        assert mine[0].priority == row.priority
        assert callable(row.fallback_kernel())
    assert oplist.parse().ops() | {r.op for r in ops.row_ops} == {e.op for e in native_entries}
    oplist.check_registrations(KERNELS)


def test_a_row_kernel_passes_the_call_as_the_row_lists_it_and_falls_back(tmp_path, monkeypatch):
    """The kernel made from a row calls the row's module function with inputs, outputs and params in the row's order;
    what the C++ refuses (a DtorchError) runs the fallback; a call the row does not count names the row."""
    import dtorch
    from dtorch.core.errors import ArgumentError, ShapeError
    from dtorch.dispatch.meta import KernelParams
    from dtorch.kernels.native import kernels

    listed = oplist.parse(_with_group(tmp_path, TOY_ROW) / "ops.def")
    ks = KernelSet(devices=("cpu",))
    kernels.register_rows(ks, listed)
    (entry,) = [e for e in ks.entries if e.fn.__name__ == "toy_scale"]  # the toy row (the tree's rows are there too)
    assert (entry.op, entry.provider, entry.dtypes, entry.meta.inplace) == (
        "llm.rms_norm", "native", (torch.float32, torch.bfloat16), True)
    calls = []

    def toy_scale(*args):
        calls.append(args)
        if len(calls) == 2:
            raise ShapeError("refused")

    monkeypatch.setattr(kernels, "lib", lambda: types.SimpleNamespace(toy_scale=toy_scale))
    x, w = torch.randn(3, 8), torch.randn(8)
    out = torch.empty(3, 8)
    ctx = dtorch.KernelContext(dtorch.Device("cpu"), params=KernelParams(eps=0.5))
    entry.fn(ctx, (x, w), (out,))
    assert calls[0][:3] == (x, w, out) and calls[0][3] == 0.5
    entry.fn(ctx, (x, w), (out,))  # refused: the fallback (the torch rms_norm) fills out
    torch.testing.assert_close(out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 0.5) * w)
    with pytest.raises(ArgumentError, match=r"DTN_OP toy_scale \(ops/toy\.def\) takes inputs \('x', 'w'\)"):
        entry.fn(ctx, (x,), (out,))
    calls.clear()  # bound once (a static plan's loop): the same call, and the same fallback, with no arguments
    entry.fn.bind(ctx, (x, w), (out,))()
    assert calls[0][:3] == (x, w, out) and calls[0][3] == 0.5
    out.zero_()
    entry.fn.bind(ctx, (x, w), (out,))()
    torch.testing.assert_close(out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 0.5) * w)
    assert entry.fn.bind(ctx, (x,), (out,)) is None


def test_an_entry_op_without_a_kernel_is_refused_naming_it(tmp_path):
    listed = oplist.parse(_with_entry(tmp_path, 'DTN_ENTRY(toy_scale, "llm.toy_scale", "x * s into out")') / "ops.def")
    with pytest.raises(RegistrationError, match=r"llm\.toy_scale \(entry toy_scale\).*kernels\.py"):
        oplist.check_registrations(KERNELS, listed)
    extra = KernelSet()  # the other way: a native kernel whose op no row names
    extra.entries = [*KERNELS.entries]
    extra.add("llm.moe_router", lambda ctx, inputs, outputs: None, [torch.float32], provider="native")
    with pytest.raises(RegistrationError, match=r"llm\.moe_router, which no row of ops\.def names"):
        oplist.check_registrations(extra)


def test_a_module_that_differs_from_the_list_is_refused():
    names = sorted(oplist.parse().functions())
    stale = types.SimpleNamespace(**{n: None for n in names[1:]}, old_fn=None)
    with pytest.raises(RegistrationError, match=rf"missing \['{names[0]}'\], not listed \['old_fn'\]"):
        oplist.check_module(stale)


@pytest.mark.parametrize("rows, listed, match", [
    ("DTN_KERNEL(toy, rope, void, (int x))", True, r"DTN_KERNEL rope is a kernel slot .* belongs in slots/toy\.def"),
    ("DTN_OP(toy, rms_norm, \"llm.x\", \"m:f\", \"\", \"\", DTN_IN(x) DTN_OUT(y))", True,
     "rms_norm declared more than once"),
    (TOY_ROW.replace("DTN_VEC(w)", "DTN_VEC(w) DTN_HALF(u)"), True, "a DTN_HALF must directly follow the first"),
    (TOY_ROW, False, r'ops\.def does not include ops/toy\.def: add #include "ops/toy\.def"'),
    (TOY_ROW.replace("(toy,", "(elementwise,"), True, "names group 'elementwise'; a row of ops/toy.def belongs to"),
    (TOY_ROW.replace("DTN_IN(x) DTN_VEC(w)", "DTN_VEC(w) DTN_IN(x)"), True, "args must start with a DTN_IN"),
    (TOY_ROW.replace("DTN_OUT(out) DTN_F32(eps)", "DTN_F32(eps) DTN_OUT(out)"), True, "then the outputs"),
    (TOY_ROW.replace("DTN_F32(eps)", "DTN_F16(eps)"), True, r"left over: 'DTN_F16\(eps\)'"),
    (TOY_ROW.replace('"inplace"', '"aliased"'), True, "meta holds words 'inplace' and 'priority=N'"),
    (TOY_ROW.replace("DTN_F32(eps))", "DTN_F32(eps)"), True, "never closed"),
    ('DTN_ENTRY(toy, "", "doc")', True, "belongs in entries.def"),
])
def test_a_malformed_row_is_refused_naming_what_to_fix(tmp_path, rows, listed, match):
    with pytest.raises(RegistrationError, match=match):
        oplist.parse(_with_group(tmp_path, rows, listed=listed) / "ops.def")


def test_a_row_whose_fallback_does_not_exist_is_refused_naming_it(tmp_path):
    listed = oplist.parse(_with_group(tmp_path, TOY_ROW.replace("rms_norm_torch", "rms_norm_trch")) / "ops.def")
    with pytest.raises(RegistrationError, match=r"ops/toy\.def: DTN_OP toy_scale: its fallback "
                                                r"'dtorch\.kernels\.torch\.llm:rms_norm_trch' does not exist"):
        next(r for r in listed.row_ops if r.name == "toy_scale").fallback_kernel()


@compiler
def test_a_row_compiles_with_its_kernel_and_fails_the_build_without_it(tmp_path):
    """The toy op's group (its row and its kernel, nothing else) compiles; the row without its kernel fails to
    compile naming the kernel and the ISA unit."""
    good = _with_group(tmp_path / "good", TOY_ROW)
    unit = next(u for u in build.units(good) if u.name == "isa_portable.toy")
    assert ObjectCache(tmp_path / "objects", CXX).build([unit], Tree(good), jobs=1).compiled == ["isa_portable.toy"]
    bad = _with_group(tmp_path / "bad", TOY_ROW, kernel="#pragma once\n")
    unit = next(u for u in build.units(bad) if u.name == "isa_portable.toy")
    with pytest.raises(CompileError) as err:
        ObjectCache(tmp_path / "objects", CXX).build([unit], Tree(bad), jobs=1)
    out = err.value.output  # "ops/toy.def:1:13: error: 'toy_scale' is not a member of 'isa_portable::kernels'"
    assert "ops/toy.def:1" in out and re.search(r".toy_scale. is not a member of .isa_portable::kernels.", out)


@compiler
def test_a_kernel_slot_without_an_implementation_fails_the_build_naming_it(tmp_path):
    """A DTN_KERNEL row that an ISA unit does not define: its group's object fails to compile, naming the op."""
    csrc = _copy(tmp_path)
    rows = csrc / "slots" / "elementwise.def"
    rows.write_text(rows.read_text() + "DTN_KERNEL(elementwise, toy_scale, void, (float* x, int64_t n, float s))\n")
    unit = next(u for u in build.units(csrc) if u.name == "isa_portable.elementwise")
    with pytest.raises(CompileError) as err:
        ObjectCache(tmp_path / "objects", CXX).build([unit], Tree(csrc), jobs=1)
    assert "toy_scale" in err.value.output and "isa_portable::kernels" in err.value.output


def test_each_isa_unit_is_one_object_per_group():
    names = [u.name for u in build.units()]
    groups = oplist.parse().groups
    assert set(groups) == {"quant", "elementwise", "attention", "recurrent", "softmax"}
    isas = [s[:-4] for s in build._units() if s.startswith("isa_")]
    assert names == ["binding", "table", *(f"{i}.{g}" for i in isas for g in groups)]


# -- incremental: only what a change reaches recompiles -------------------------------------------------------

def _tiny_tree(root: Path) -> list[Unit]:
    """Two units: a.cpp includes h.h, b.cpp includes g.h."""
    root.mkdir()
    (root / "h.h").write_text("inline int h() { return 1; }\n")
    (root / "g.h").write_text("inline int g() { return 2; }\n")
    (root / "a.cpp").write_text('#include "h.h"\nint a() { return h(); }\n')
    (root / "b.cpp").write_text('#include "g.h"\nint b() { return g(); }\n')
    return [Unit("a", "a.cpp", ("-O0", "-fPIC")), Unit("b", "b.cpp", ("-O0", "-fPIC"))]


@compiler
def test_a_change_recompiles_only_the_objects_that_include_it(tmp_path):
    root = tmp_path / "src"
    units = _tiny_tree(root)
    cache = ObjectCache(tmp_path / "objects", CXX)

    def compiled():
        return cache.build(units, Tree(root), jobs=2).compiled

    assert compiled() == ["a", "b"]
    assert compiled() == []
    (root / "h.h").write_text("inline int h() { return 3; }\n")
    assert compiled() == ["a"]
    (root / "b.cpp").write_text('#include "g.h"\nint b() { return g() + 1; }\n')
    assert compiled() == ["b"]
    (root / "g.h").write_text('#include "h.h"\ninline int g() { return h(); }\n')  # b now reads h.h too
    assert compiled() == ["b"]
    (root / "h.h").write_text("inline int h() { return 4; }\n")
    assert compiled() == ["a", "b"]
    (root / "h.h").write_text("inline int h() { return 1; }\n")  # back to the first contents: cached objects
    (root / "g.h").write_text("inline int g() { return 2; }\n")
    (root / "b.cpp").write_text('#include "g.h"\nint b() { return g(); }\n')
    assert compiled() == []  # the first objects are there, found by the manifests' first lists of files


@compiler
@compiler
def test_two_trees_built_in_turn_keep_their_objects(tmp_path):
    """Two trees that share the object cache (main and a worktree), whose unit reads other files: building them in
    turn compiles each once; neither's manifest hides the other's object."""
    first, second = tmp_path / "first", tmp_path / "second"
    units = _tiny_tree(first)
    _tiny_tree(second)
    (second / "a.cpp").write_text('#include "g.h"\nint a() { return g(); }\n')  # a reads g.h here, h.h there
    cache = ObjectCache(tmp_path / "objects", CXX)
    assert cache.build(units, Tree(first), jobs=2).compiled == ["a", "b"]
    assert cache.build(units, Tree(second), jobs=2).compiled == ["a"]
    assert cache.build(units, Tree(first), jobs=2).compiled == []
    assert cache.build(units, Tree(second), jobs=2).compiled == []


@compiler
def test_two_processes_building_at_once_both_get_whole_objects(tmp_path):
    root = tmp_path / "src"
    _tiny_tree(root)
    code = textwrap.dedent(f"""
        from pathlib import Path
        from dtorch.kernels.native.objcache import ObjectCache, Tree, Unit
        units = [Unit("a", "a.cpp", ("-O0", "-fPIC")), Unit("b", "b.cpp", ("-O0", "-fPIC"))]
        res = ObjectCache(Path({str(tmp_path / 'objects')!r}), {CXX!r}).build(units, Tree(Path({str(root)!r})), 2)
        print(*res.objects)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1]  # one key per unit: both name the same objects
    for obj in outs[0]:
        assert Path(obj).stat().st_size > 0
    assert not list((tmp_path / "objects").glob(".*"))  # no temporary left behind


def test_the_library_objects_a_change_reaches(tmp_path):
    """On the real units, with the object cache the library was built from: nothing is stale for an unchanged copy of
    csrc; a change to one kernel header makes stale exactly the objects that include it; a new declared op (its own
    group, or a row in a group) exactly its group's objects and table.cpp, never binding.cpp (the unit with torch's
    headers); a hand-written slot its group's objects, table.cpp and binding.cpp."""
    if _REASON is not None:
        pytest.skip(f"native kernels unavailable: {_REASON}")
    csrc = _copy(tmp_path / "real")
    cache = ObjectCache(build.objects_dir(), CXX)

    def stale(root=csrc):
        tree = Tree(root)
        return sorted(u.name for u in build.units(root) if cache.cached(u, tree) is None)

    if stale():
        pytest.skip("the object cache does not hold this library's objects (it was built before the object cache)")
    isas = [s[:-4] for s in build._units() if s.startswith("isa_")]

    def objects(*groups, table=False, binding=False):
        return sorted([f"{i}.{g}" for i in isas for g in groups] + (["table"] if table else [])
                      + (["binding"] if binding else []))

    for header, want in (("ops/recurrent.h", objects("recurrent")),
                         ("ops/elementwise.h", objects("elementwise")),
                         ("rows.h", objects(*oplist.parse().groups)),
                         ("binding.cpp", ["binding"]),
                         ("ops/elementwise.def", objects("elementwise", table=True)),
                         ("ops.def", ["table"]),
                         ("slots/elementwise.def", objects("elementwise", table=True, binding=True)),
                         ("entries.def", ["binding", "table"])):
        before = (csrc / header).read_text()
        (csrc / header).write_text(before + "\n// touched\n")
        assert stale() == want, header
        (csrc / header).write_text(before)
    assert stale() == []
    assert stale(_with_group(tmp_path / "toy", TOY_ROW)) == objects("toy", table=True)
    in_group = _copy(tmp_path / "in_group")  # the toy op in the elementwise group instead
    for name, text in (("elementwise.def", TOY_ROW.replace("(toy,", "(elementwise,")),
                       ("elementwise.h", TOY_KERNEL.replace("#pragma once\n", ""))):
        f = in_group / "ops" / name
        f.write_text(f.read_text() + text + "\n")
    assert stale(in_group) == objects("elementwise", table=True)
