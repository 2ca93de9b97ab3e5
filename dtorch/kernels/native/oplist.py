"""The native op list as Python reads it: the ops declared whole (``DTN_OP`` rows of ``csrc/ops/<group>.def``, the
groups listed in ``csrc/ops.def``), and the hand-written part (``csrc/entries.def``): the module's hand-written
entries with the dispatcher ops whose native kernels call them, and the kernel slots they call (``DTN_KERNEL`` /
``DTN_VALUE`` rows of ``csrc/slots/<group>.def``).

The rows are the one declaration of a native op: the C++ tables, the per-ISA objects (``build.py`` compiles one per
ISA and group) and the module's functions follow from them in C++; here ``kernels.py`` registers each ``DTN_OP`` row
with the dispatcher (``row_kernel``), the loader checks a loaded module against the rows (``check_module``) and
``install`` checks the hand-written registrations of ``kernels.py`` against the ops the ``DTN_ENTRY`` rows name
(``check_registrations``). Every failure names what to add and where.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dtorch.core.errors import RegistrationError

CSRC = Path(__file__).parent / "csrc"
OPS_DEF = CSRC / "ops.def"
ENTRIES = "entries.def"  # beside ops.def

_CALL = re.compile(r"\bDTN_(KERNEL|VALUE|OP|ENTRY)\s*\(")
_ARG = re.compile(r"DTN_(IN|HALF|VEC|OUT|F32|I64|BOOL)\(\s*(\w+)\s*\)")
# the argument kinds of a DTN_OP row, in the order the row must list them: the op's inputs, outputs, params
_ARG_ORDER = {"IN": 0, "HALF": 0, "VEC": 0, "OUT": 1, "F32": 2, "I64": 2, "BOOL": 2}
_META = re.compile(r"^(inplace|priority=-?\d+)$")  # the words of a DTN_OP row's meta


@dataclass(frozen=True)
class Slot:
    """A field of the ISA tables: a kernel (``kind`` "kernel"), a per-ISA constant ("value") or the kernel of a
    DTN_OP row ("op"), and its group."""

    name: str
    group: str
    kind: str


@dataclass(frozen=True)
class Entry:
    """A hand-written function of the module ``_dtorch_native``: the dispatcher ops whose native kernels call it (none
    for the module's controls and load-time helpers) and its docstring."""

    name: str
    ops: tuple[str, ...]
    doc: str


@dataclass(frozen=True)
class RowOp:
    """A DTN_OP row: the module function ``name`` and the dispatcher op ``op`` it serves, declared whole.

    ``args`` are (kind, name) pairs in the row's order: kinds IN, HALF and VEC are the op's inputs, OUT its outputs,
    F32, I64 and BOOL its params (read as ``ctx.params.<name>``). ``fallback`` ("module:function") is the torch kernel
    that runs what the C++ refuses; ``meta`` words: "inplace" when the output may be the input, "priority=N" where the
    native provider's default (30) is not right.
    """

    name: str
    group: str
    op: str
    fallback: str
    meta: str
    doc: str
    args: tuple[tuple[str, str], ...]
    where: str  # "ops/<group>.def" for messages

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(n for k, n in self.args if _ARG_ORDER[k] == 0)

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(n for k, n in self.args if _ARG_ORDER[k] == 1)

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(n for k, n in self.args if _ARG_ORDER[k] == 2)

    @property
    def inplace(self) -> bool:
        return "inplace" in self.meta.split()

    @property
    def priority(self) -> int | None:
        return next((int(w[9:]) for w in self.meta.split() if w.startswith("priority=")), None)

    def fallback_kernel(self) -> Callable:
        """The fallback kernel the row names, imported; a RegistrationError naming the row when it does not exist."""
        module, _, fn = self.fallback.partition(":")
        try:
            return getattr(importlib.import_module(module), fn)
        except (ImportError, AttributeError) as e:
            raise RegistrationError(
                f"{self.where}: DTN_OP {self.name}: its fallback {self.fallback!r} does not exist ({e}); name the "
                f"torch kernel of {self.op} as \"module:function\" (e.g. \"dtorch.kernels.torch.llm:rms_norm_torch\")"
            ) from None


@dataclass(frozen=True)
class OpList:
    slots: tuple[Slot, ...]
    entries: tuple[Entry, ...]
    row_ops: tuple[RowOp, ...] = ()
    group_names: tuple[str, ...] = ()

    @property
    def groups(self) -> tuple[str, ...]:
        """The groups in the order ops.def includes them: one object per ISA unit and group."""
        return self.group_names or tuple(dict.fromkeys(s.group for s in self.slots))

    def functions(self) -> set[str]:
        """Every function the module has: the DTN_ENTRY and DTN_OP rows."""
        return {e.name for e in self.entries} | {r.name for r in self.row_ops}

    def ops(self) -> set[str]:
        """Every dispatcher op a hand-written entry names (the DTN_OP rows' ops are registered from the rows)."""
        return {op for e in self.entries for op in e.ops}


def _code(text: str) -> str:
    """The text without its comments and preprocessor lines (the #include lines of ops.def)."""
    lines = (ln.split("//", 1)[0] for ln in text.splitlines())
    return "\n".join(ln for ln in lines if not ln.lstrip().startswith("#"))


def _calls(code: str, where: str) -> list[tuple[str, list[str]]]:
    """The DTN_* macro calls of ``code``: (kind, arguments split at the top-level commas, stripped)."""
    out = []
    for m in _CALL.finditer(code):
        depth, args, cur, quoted = 1, [], [], False
        for i in range(m.end(), len(code) + 1):
            if i == len(code):
                raise RegistrationError(f"{where}: DTN_{m.group(1)} at '{code[m.start():m.start() + 40]}...' is "
                                        "never closed: a ')' is missing")
            c = code[i]
            quoted ^= c == '"'
            if not quoted and c in "(),":
                depth += {"(": 1, ")": -1, ",": 0}[c]
                if depth == 0:
                    break
                if c == "," and depth == 1:
                    args.append("".join(cur).strip())
                    cur = []
                    continue
            cur.append(c)
        out.append((m.group(1), [*args, "".join(cur).strip()]))
    return out


def _unquote(s: str, what: str, where: str) -> str:
    if len(s) < 2 or s[0] != '"' or s[-1] != '"':
        raise RegistrationError(f"{where}: {what} must be a string literal, got {s!r}")
    return s[1:-1]


def _row_op(args: list[str], where: str) -> RowOp:
    if len(args) != 7:
        raise RegistrationError(f"{where}: DTN_OP takes 7 arguments (group, name, \"op\", \"module:fallback\", "
                                f"\"meta\", \"doc\", args), got {len(args)}: {', '.join(args)}")
    group, name, op, fallback, meta, doc, spec = args
    what = f"DTN_OP {name}"
    op, fallback, meta, doc = (_unquote(v, f"{what}'s {k}", where)
                               for k, v in (("op", op), ("fallback", fallback), ("meta", meta), ("doc", doc)))
    parsed = tuple((k, n) for k, n in _ARG.findall(spec))
    if _ARG.sub("", spec).strip():
        raise RegistrationError(f"{where}: {what}: args may hold only DTN_IN, DTN_HALF, DTN_VEC, DTN_OUT, DTN_F32, "
                                f"DTN_I64 and DTN_BOOL, each with one name; left over: {_ARG.sub('', spec).strip()!r}")
    kinds = [_ARG_ORDER[k] for k, _ in parsed]
    if not parsed or parsed[0][0] != "IN" or 1 not in kinds or kinds != sorted(kinds):
        raise RegistrationError(f"{where}: {what}: args must start with a DTN_IN (it fixes the dtype and rows), then "
                                "the other inputs, then the outputs (at least one DTN_OUT), then the params; got "
                                f"{spec!r}")
    if any(k == "HALF" for k, _ in parsed[2:]) or [k for k, _ in parsed].count("HALF") > 1:
        raise RegistrationError(f"{where}: {what}: a DTN_HALF must directly follow the first DTN_IN (the fused input's "
                                f"second half), and a row has at most one; got {spec!r}")
    names = [n for _, n in parsed]
    if len(set(names)) != len(names) or {"dt", "R", "D"} & set(names):
        raise RegistrationError(f"{where}: {what}: argument names must differ from each other and from dt, R, D; "
                                f"got {', '.join(names)}")
    if not all(_META.match(w) for w in meta.split()):
        raise RegistrationError(f"{where}: {what}: meta holds words 'inplace' and 'priority=N' (or nothing), got "
                                f"{meta!r}")
    if "." not in op or ":" not in fallback:
        raise RegistrationError(f"{where}: {what}: op must be a dispatcher op (\"llm.name\") and fallback a "
                                f"\"module:function\"; got {op!r}, {fallback!r}")
    return RowOp(name, group, op, fallback, meta, doc, parsed, where)


def _includes(text: str, folder: str) -> tuple[str, ...]:
    return tuple(re.findall(rf'^\s*#include\s+"{folder}/(\w+)\.def"', text, re.M))


def _group_rows(path: Path, group: str, slots: list[Slot], row_ops: list[RowOp]) -> None:
    """The rows of ``ops/<group>.def`` (DTN_OP only) or ``slots/<group>.def`` (DTN_KERNEL and DTN_VALUE only)."""
    where = f"{path.parent.name}/{path.name}"
    declared = path.parent.name == "ops"
    for kind, args in _calls(_code(path.read_text()), where):
        name = args[1] if len(args) > 1 else ""
        if kind == "ENTRY":
            raise RegistrationError(f"{where}: DTN_ENTRY {args[0]} belongs in {ENTRIES} (the module's hand-written "
                                    "functions), not in a group's file")
        if declared and kind != "OP":
            raise RegistrationError(f"{where}: DTN_{kind} {name} is a kernel slot of a hand-written entry: it belongs "
                                    f"in slots/{group}.def (listed in {ENTRIES}); ops/{group}.def holds DTN_OP rows")
        if not declared and kind == "OP":
            raise RegistrationError(f"{where}: DTN_OP {name} belongs in ops/{group}.def (listed in ops.def); "
                                    f"slots/{group}.def holds the hand-written entries' DTN_KERNEL and DTN_VALUE rows")
        if args[0] != group:
            raise RegistrationError(f"{where}: DTN_{kind} {name} names group {args[0]!r}; a row of {where} belongs to "
                                    f"group {group!r}")
        if kind == "OP":
            row_ops.append(_row_op(args, where))
            slots.append(Slot(args[1], group, "op"))
        else:  # DTN_KERNEL(group, op, ret, params); DTN_VALUE(group, type, name)
            slots.append(Slot(args[1] if kind == "KERNEL" else args[2], group, kind.lower()))


def _listed_files(listing: Path, folder: str, groups: tuple[str, ...], slots: list[Slot],
                  row_ops: list[RowOp]) -> None:
    """The rows of each group file ``listing`` includes from ``folder``; a listed file that is missing, or a file of
    the folder that is not listed, names the fix."""
    for g in groups:
        f = listing.parent / folder / f"{g}.def"
        if not f.is_file():
            raise RegistrationError(f"{listing.name} includes {folder}/{g}.def, which does not exist: create it with "
                                    "the group's rows, or remove the line")
        _group_rows(f, g, slots, row_ops)
    unlisted = sorted(p.name for p in (listing.parent / folder).glob("*.def") if p.stem not in groups)
    if unlisted:
        raise RegistrationError(f"{listing.name} does not include {', '.join(folder + '/' + n for n in unlisted)}: add "
                                + " ".join(f'#include "{folder}/{n}"' for n in unlisted) + " to its list of groups")


def parse(path: Path = OPS_DEF) -> OpList:
    """The list: ``path`` (ops.def) and the group files it includes, ``entries.def`` beside it and the slot files it
    includes; a name declared twice, a group file that is missing or not included, a row in the wrong file or a
    malformed row is a RegistrationError naming it."""
    entries_path = path.parent / ENTRIES
    text, entries_text = path.read_text(), entries_path.read_text()
    op_groups, slot_groups = _includes(text, "ops"), _includes(entries_text, "slots")
    slots: list[Slot] = []
    row_ops: list[RowOp] = []
    _listed_files(entries_path, "slots", slot_groups, slots, row_ops)
    _listed_files(path, "ops", op_groups, slots, row_ops)
    for kind, args in _calls(_code(text), path.name):
        home = {"ENTRY": ENTRIES, "OP": "ops/<group>.def"}.get(kind, "slots/<group>.def")
        raise RegistrationError(f"{path.name}: DTN_{kind} {args[1] if len(args) > 1 else args[0]} belongs in {home}; "
                                f"{path.name} only lists the groups")
    entries = []
    for kind, args in _calls(_code(entries_text), ENTRIES):
        if kind != "ENTRY":
            home = "ops/<group>.def" if kind == "OP" else "slots/<group>.def"
            raise RegistrationError(f"{ENTRIES}: DTN_{kind} {args[1] if len(args) > 1 else ''} belongs in {home}")
        name, ops, doc = args
        entries.append(Entry(name, tuple(_unquote(ops, f"DTN_ENTRY {name}'s ops", ENTRIES).split()),
                             _unquote(doc, f"DTN_ENTRY {name}'s doc", ENTRIES)))
    for what, names in (("kernel slot", [s.name for s in slots]),
                        ("module function", [e.name for e in entries] + [r.name for r in row_ops])):
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise RegistrationError(f"{path.parent}: {what} {', '.join(twice)} declared more than once")
    return OpList(tuple(slots), tuple(entries), tuple(row_ops), tuple(dict.fromkeys((*slot_groups, *op_groups))))


def check_module(mod, oplist: OpList | None = None) -> None:
    """Raise RegistrationError unless the module's public functions are exactly the list's functions (a library built
    from another ops.def, or a binding that adds a method by hand)."""
    oplist = oplist or parse()
    want = oplist.functions()
    have = {n for n in dir(mod) if not n.startswith("_")}
    if want != have:
        raise RegistrationError(
            f"the native module {getattr(mod, '__file__', mod)} does not match {OPS_DEF.name}: missing "
            f"{sorted(want - have) or 'none'}, not listed {sorted(have - want) or 'none'}; rebuild it "
            "(python -m dtorch.kernels.native.build --force)")


def check_registrations(kernel_set, oplist: OpList | None = None, provider: str = "native") -> None:
    """Raise RegistrationError unless the ops that ``kernel_set`` (a KernelSet) registers for ``provider`` are exactly
    the ops the list names: the DTN_OP rows' ops (registered from the rows) and the ops of the DTN_ENTRY rows (a
    hand-written kernel each): a listed op with no kernel, or a kernel whose op no row names."""
    oplist = oplist or parse()
    registered = {e.op for e in kernel_set.entries if e.provider == provider}
    rows = {r.op: r for r in oplist.row_ops}
    unregistered = sorted(set(rows) - registered)
    if unregistered:
        raise RegistrationError(
            "DTN_OP rows whose op has no native kernel: "
            + ", ".join(f"{op} ({rows[op].where}: {rows[op].name})" for op in unregistered)
            + ": kernels.py registers every DTN_OP row (register_rows); is it installed from this op list?")
    declared = oplist.ops()
    unregistered = sorted(declared - registered)
    if unregistered:
        users = {op: [e.name for e in oplist.entries if op in e.ops] for op in unregistered}
        raise RegistrationError(
            "entries.def names dispatcher ops that kernels.py / products.py register no native kernel for: "
            + "; ".join(f"{op} (entry {', '.join(users[op])})" for op in unregistered)
            + ": add KERNELS.add / @KERNELS.kernel(op, ..., provider='native') in dtorch/kernels/native/kernels.py "
              "(or products.py for a product)")
    undeclared = sorted(registered - declared - set(rows))
    if undeclared:
        raise RegistrationError(
            f"kernels.py / products.py register native kernels for {', '.join(undeclared)}, which no row of ops.def "
            "names: "
            "declare it whole as a DTN_OP row (csrc/ops/<group>.def), or list the op in the DTN_ENTRY line of the "
            "function its kernel calls (csrc/entries.def)")
