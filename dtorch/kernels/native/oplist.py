"""The native op list (``csrc/ops.def``) as Python reads it: the kernel slots of the ISA tables with their groups,
and the module's entries with the dispatcher ops whose native kernels call them.

ops.def is the one declaration of a native op: the C++ tables, the per-ISA objects (``build.py`` compiles one per ISA
and group) and the module's functions follow from it in C++; here the loader checks a loaded module against its
entries (``check_module``) and ``install`` checks the dispatcher registrations of ``kernels.py`` against the ops the
entries name (``check_registrations``). Both failures name what to add and where.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dtorch.core.errors import RegistrationError

OPS_DEF = Path(__file__).parent / "csrc" / "ops.def"

_KERNEL = re.compile(r"\bDTN_(KERNEL|VALUE)\(\s*(\w+)\s*,\s*(\w+)\s*,\s*(\w+)")
_ENTRY = re.compile(r'\bDTN_ENTRY\(\s*(\w+)\s*,\s*"([^"]*)"\s*,\s*"([^"]*)"\s*\)')


@dataclass(frozen=True)
class Slot:
    """A field of the ISA tables: a kernel (``kind`` "kernel") or a per-ISA constant ("value"), and its group."""

    name: str
    group: str
    kind: str


@dataclass(frozen=True)
class Entry:
    """A function of the module ``_dtorch_native``: the dispatcher ops whose native kernels call it (none for the
    module's controls and load-time helpers) and its docstring."""

    name: str
    ops: tuple[str, ...]
    doc: str


@dataclass(frozen=True)
class OpList:
    slots: tuple[Slot, ...]
    entries: tuple[Entry, ...]

    @property
    def groups(self) -> tuple[str, ...]:
        """The groups in order of first appearance: one object per ISA unit and group."""
        return tuple(dict.fromkeys(s.group for s in self.slots))

    def ops(self) -> set[str]:
        """Every dispatcher op some entry names."""
        return {op for e in self.entries for op in e.ops}


def _code(text: str) -> str:
    """The text without its comments and preprocessor lines (the #define / #undef of the macros themselves)."""
    lines = (ln.split("//", 1)[0] for ln in text.splitlines())
    return "\n".join(ln for ln in lines if not ln.lstrip().startswith("#"))


def parse(path: Path = OPS_DEF) -> OpList:
    """The list in ``path``; a name declared twice is a RegistrationError naming it."""
    code = _code(path.read_text())
    slots = []
    for kind, group, a, b in _KERNEL.findall(code):
        # DTN_KERNEL(group, op, ret, ...); DTN_VALUE(group, type, name)
        slots.append(Slot(a if kind == "KERNEL" else b, group, kind.lower()))
    entries = [Entry(n, tuple(ops.split()), doc) for n, ops, doc in _ENTRY.findall(code)]
    for what, names in (("kernel slot", [s.name for s in slots]), ("entry", [e.name for e in entries])):
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise RegistrationError(f"{path}: {what} {', '.join(twice)} declared more than once")
    return OpList(tuple(slots), tuple(entries))


def check_module(mod, oplist: OpList | None = None) -> None:
    """Raise RegistrationError unless the module's public functions are exactly the list's entries (a library built
    from another ops.def, or a binding that adds a method by hand)."""
    oplist = oplist or parse()
    want = {e.name for e in oplist.entries}
    have = {n for n in dir(mod) if not n.startswith("_")}
    if want != have:
        raise RegistrationError(
            f"the native module {getattr(mod, '__file__', mod)} does not match {OPS_DEF.name}: missing "
            f"{sorted(want - have) or 'none'}, not listed {sorted(have - want) or 'none'}; rebuild it "
            "(python -m dtorch.kernels.native.build --force)")


def check_registrations(kernel_set, oplist: OpList | None = None, provider: str = "native") -> None:
    """Raise RegistrationError unless the ops that ``kernel_set`` (a KernelSet) registers for ``provider`` are exactly
    the ops the list's entries name: an entry's op with no kernel, or a kernel whose op no entry names."""
    oplist = oplist or parse()
    registered = {e.op for e in kernel_set.entries if e.provider == provider}
    declared = oplist.ops()
    unregistered = sorted(declared - registered)
    if unregistered:
        users = {op: [e.name for e in oplist.entries if op in e.ops] for op in unregistered}
        raise RegistrationError(
            "ops.def names dispatcher ops that kernels.py registers no native kernel for: "
            + "; ".join(f"{op} (entry {', '.join(users[op])})" for op in unregistered)
            + ": add KERNELS.add / @KERNELS.kernel(op, ..., provider='native') in dtorch/kernels/native/kernels.py")
    undeclared = sorted(registered - declared)
    if undeclared:
        raise RegistrationError(
            f"kernels.py registers native kernels for {', '.join(undeclared)}, which no entry of ops.def names: "
            "list the op in the DTN_ENTRY line of the function its kernel calls (csrc/ops.def)")
