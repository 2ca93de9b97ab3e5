"""The native op list (csrc/ops.def) drives the tables, the module and the registrations; the native build compiles
one object per unit and group, keyed by its own inputs, and recompiles only what a change reaches.

What is measured is which objects were compiled, never how long that took (bench/README.md has the times).
"""

from __future__ import annotations

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


def _with_line(tmp_path: Path, line: str) -> Path:
    """A copy of csrc whose ops.def declares ``line`` too (after the last entry)."""
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    text = (csrc / "ops.def").read_text()
    (csrc / "ops.def").write_text(text.replace("\n#undef DTN_KERNEL", f"\n{line}\n#undef DTN_KERNEL", 1))
    return csrc


# -- the declaration drives everything -----------------------------------------------------------------------

@native
def test_module_functions_are_the_list_entries():
    """The compiled module has exactly the entries of ops.def, each with its doc; each kernel slot of the list has a
    function in every ISA unit (else the module would not load: table.cpp refuses an incomplete table)."""
    mod = nk.load()
    entries = oplist.parse().entries
    assert {e.name for e in entries} == {n for n in dir(mod) if not n.startswith("_")}
    for e in entries:
        assert getattr(mod, e.name).__doc__ == e.doc
    for isa in nk.available_isas():  # every table the CPU runs is complete and selectable
        with nk.use_isa(isa):
            assert nk.isa() == isa


def test_list_names_the_ops_kernels_py_registers():
    """Every dispatcher op an entry names has a native kernel, and every native kernel's op is named by an entry."""
    assert oplist.parse().ops() == {e.op for e in KERNELS.entries if e.provider == "native"}
    oplist.check_registrations(KERNELS)


def test_an_entry_op_without_a_kernel_is_refused_naming_it(tmp_path):
    listed = oplist.parse(_with_line(tmp_path, 'DTN_ENTRY(toy_scale, "llm.toy_scale", "x * s into out")') / "ops.def")
    with pytest.raises(RegistrationError, match=r"llm\.toy_scale \(entry toy_scale\).*kernels\.py"):
        oplist.check_registrations(KERNELS, listed)
    extra = KernelSet()  # the other way: a native kernel whose op no entry names
    extra.entries = [*KERNELS.entries]
    extra.add("llm.softcap", lambda ctx, inputs, outputs: None, [torch.float32], provider="native")
    with pytest.raises(RegistrationError, match=r"llm\.softcap, which no entry of ops\.def names"):
        oplist.check_registrations(extra)


def test_a_module_that_differs_from_the_list_is_refused():
    names = [e.name for e in oplist.parse().entries]
    stale = types.SimpleNamespace(**{n: None for n in names[1:]}, old_fn=None)
    with pytest.raises(RegistrationError, match=rf"missing \['{names[0]}'\], not listed \['old_fn'\]"):
        oplist.check_module(stale)


def test_a_name_declared_twice_is_refused(tmp_path):
    csrc = _with_line(tmp_path, "DTN_KERNEL(elementwise, rope, void, (int x))")
    with pytest.raises(RegistrationError, match="kernel slot rope declared more than once"):
        oplist.parse(csrc / "ops.def")


@compiler
def test_a_kernel_without_an_implementation_fails_the_build_naming_it(tmp_path):
    """A slot in ops.def that an ISA unit does not define: its group's object fails to compile, naming the op."""
    csrc = _with_line(tmp_path, "DTN_KERNEL(elementwise, toy_scale, void, (float* x, int64_t n, float s))")
    unit = next(u for u in build.units(csrc) if u.name == "isa_portable.elementwise")
    with pytest.raises(CompileError) as err:
        ObjectCache(tmp_path / "objects", CXX).build([unit], Tree(csrc), jobs=1)
    assert "toy_scale" in err.value.output and "isa_portable::kernels" in err.value.output


def test_each_isa_unit_is_one_object_per_group():
    names = [u.name for u in build.units()]
    groups = oplist.parse().groups
    assert set(groups) == {"quant", "elementwise", "attention", "recurrent"}
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
    assert compiled() == ["b"]  # a's first object is there; b's first object was compiled under its old manifest


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


def test_the_library_objects_a_header_change_reaches(tmp_path):
    """On the real units, with the object cache the library was built from: nothing is stale for an unchanged copy of
    csrc, and a change to one kernel header makes stale exactly the objects that include it."""
    if _REASON is not None:
        pytest.skip(f"native kernels unavailable: {_REASON}")
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    cache = ObjectCache(build.objects_dir(), CXX)

    def stale():
        tree = Tree(csrc)
        return sorted(u.name for u in build.units(csrc) if cache.cached(u, tree) is None)

    if stale():
        pytest.skip("the object cache does not hold this library's objects (it was built before the object cache)")
    isas = [s[:-4] for s in build._units() if s.startswith("isa_")]
    for header, groups in (("recurrent.h", ["recurrent"]), ("elementwise.h", ["attention", "elementwise", "recurrent"]),
                           ("binding.cpp", None)):
        before = (csrc / header).read_text()
        (csrc / header).write_text(before + "\n// touched\n")
        want = ["binding"] if groups is None else sorted(f"{i}.{g}" for i in isas for g in groups)
        assert stale() == want, header
        (csrc / header).write_text(before)
    assert stale() == []
