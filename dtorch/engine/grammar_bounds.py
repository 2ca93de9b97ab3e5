"""What a grammar may cost before llguidance compiles it, and where it compiles.

llguidance compiles a grammar by recursion over its rules: each rule (or ``$ref``) in a chain costs 2 to 5 KB of C
stack, and a chain of 3000 Lark rules, 5000 GBNF rules or ~1000 ``$ref``-linked objects overflows a thread's 8 MB
stack and kills the process (SIGSEGV; no Python exception is possible). So a grammar is measured first, in *parts*
(lines, JSON objects and arrays: every link of a chain needs one), refused past ``MAX_GRAMMAR_PARTS``, and compiled on
a thread whose stack holds the deepest chain that many parts can make, with room to spare (``COMPILE_STACK_BYTES``,
reserved address space that only a deep chain touches).

Measured on llguidance 1.9 (16 MB stack, the chain length that still compiled): Lark ``r: r2`` 5100 (3.2 KB a rule),
Lark ``r: (r2 | "a")* "b"?`` 3400 (4.7 KB), GBNF 6700 (2.4 KB), ``$ref`` alone 4800 (3.3 KB), ``{"type": "array",
"items": {"$ref"}}`` 2100 (7.3 KB for 2 parts), an object with a required ``$ref`` property 1700 (9 KB for 4 parts).
At ``MAX_GRAMMAR_PARTS`` the worst of these needs ~75 MB, a third of the stack given.

A JSON schema can also be impossible without a loop the compiler sees: an object whose required property refers back
to the object (``{"properties": {"a": {"$ref": "#"}}, "required": ["a"]}``) matches no finite value, yet compiles and
lets a model write ``{"a": {"a": ...`` until its token limit. ``endless_at`` finds such schemas.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import unquote

from dtorch.core.errors import DtorchError, SamplingError

MAX_GRAMMAR_PARTS = 16_000  # lines + JSON objects + JSON arrays of the text handed to llguidance; choice options
# llguidance converts GBNF to Lark in time quadratic in a chain's length (its rules' "is terminal" fixpoint takes one
# pass per link): 3000 chained rules took 6 s of a busy core
MAX_GBNF_RULES = 2000
# a parser row holds at most this many items (llguidance's max_items_in_row and step_max_items, set to it): a grammar
# with more alternatives than that could fail mid-answer (llguidance's error, and an answer cut short), so it is
# refused whole; a choice is one lexeme and needs no row
MAX_ALTERNATIVES = 50_000
COMPILE_STACK_BYTES = 256 << 20  # the compiling thread's stack (address space; touched only as deep as it recurses)
# levels of JSON objects and arrays a schema given inline may nest (a request's body cannot nest ~1000: Python's JSON
# parser stops there; a library caller's dict could, and json.dumps would meet Python's recursion limit)
MAX_SCHEMA_DEPTH = 256

T = TypeVar("T")
_stack_lock = threading.Lock()  # threading.stack_size is process-wide: set, start, restore under one lock


def grammar_parts(text: str) -> int:
    """An upper bound on the rule chain ``text`` can make: its lines (a Lark or GBNF rule is one at least) plus its
    ``{`` and ``[`` (a JSON schema's objects and arrays, inline ``%json`` included)."""
    return text.count("\n") + text.count("{") + text.count("[")


def check_parts(parts: int, field: str) -> None:
    """``SamplingError`` naming ``field`` and the limit when a grammar has more than ``MAX_GRAMMAR_PARTS`` parts."""
    if parts > MAX_GRAMMAR_PARTS:
        raise SamplingError(f"SamplingParams: structured_outputs: {field}: the grammar has {parts} parts (rules, "
                            f"lines, JSON objects and arrays), more than the {MAX_GRAMMAR_PARTS} allowed; split it or "
                            "use $defs shared by reference")


def check_alternatives(text: str, field: str) -> None:
    """``SamplingError`` naming ``field`` when grammar ``text`` has more than ``MAX_ALTERNATIVES`` ``|``."""
    alternatives = text.count("|")
    if alternatives > MAX_ALTERNATIVES:
        raise SamplingError(f"SamplingParams: structured_outputs: {field}: the grammar has {alternatives} "
                            f"alternatives (|), more than the {MAX_ALTERNATIVES} a parser step may hold; for a list "
                            "of strings use choice (one lexeme) or a JSON enum")


def check_gbnf(text: str) -> None:
    """``SamplingError`` when GBNF grammar ``text`` defines more than ``MAX_GBNF_RULES`` rules."""
    rules = text.count("::=")
    if rules > MAX_GBNF_RULES:
        raise SamplingError(f"SamplingParams: structured_outputs: grammar: the GBNF grammar has {rules} rules, more "
                            f"than the {MAX_GBNF_RULES} allowed; write it in Lark (up to {MAX_GRAMMAR_PARTS} lines)")


def nesting_depth(value: Any) -> int:
    """How deeply lists and dicts (JSON arrays and objects) nest in ``value`` (a scalar: 0), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (list, tuple, dict)) and d > deepest:
            deepest = d
        if isinstance(v, dict):
            todo += [(x, d + 1) for x in v.values()]
        elif isinstance(v, (list, tuple)):
            todo += [(x, d + 1) for x in v]
    return deepest


def on_big_stack(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a new thread with a ``COMPILE_STACK_BYTES`` stack; returns its value or raises its error."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # handed to the caller's thread as is
            out["error"] = e

    with _stack_lock:
        old = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="dtorch-grammar-compile", daemon=True)
            thread.start()
        except RuntimeError as e:  # no memory or address space for its stack
            raise DtorchError(f"no thread could be started to compile the grammar on a {COMPILE_STACK_BYTES >> 20} "
                              f"MB stack ({e}); free memory and retry") from None
        finally:
            threading.stack_size(old)
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2() -> Callable[[], Any] | None:
    """glibc's ``mallinfo2`` (2.33+), or None elsewhere."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _mallinfo2()


def heap_bytes() -> int | None:
    """Bytes the C heap holds now (llguidance allocates with ``malloc``), or None where it cannot be read."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd  # in use in the arenas + in their own maps


# --- schemas no finite value matches ---------------------------------------------------------------------------------

def endless_at(schema: Any) -> str | None:
    """The JSON pointer of a subschema of ``schema`` (a JSON schema as a dict) that no finite value matches because
    what it requires refers back to itself (a required property, a minItems item, every anyOf branch, a ``$ref``),
    or None. Only ``type: "object"``/``"array"`` schemas require their parts; a schema that allows another type
    (or names none) has a value without them. References other than local JSON pointers count as satisfiable."""
    nodes: dict[int, tuple[Any, str]] = {}  # id -> (subschema, its pointer)
    needs: dict[int, list[list[int]]] = {}  # id -> [alternatives...] that all must be satisfiable (AND of ORs)
    todo = [(schema, "#")]
    while todo:
        s, where = todo.pop()
        if id(s) in nodes or not isinstance(s, dict | bool):
            continue
        nodes[id(s)] = (s, where)
        needs[id(s)] = [[]] if s is False else []  # false: an empty OR, never met
        if isinstance(s, dict):
            for group, paths in _requires(schema, s, where):
                needs[id(s)].append([id(p) for p in group])
                todo.extend(zip(group, paths, strict=True))
    met = _least_fixed_point(needs)
    return next((where for i, (_, where) in nodes.items() if i not in met), None)


def _requires(root: dict, s: dict, where: str) -> list[tuple[list[Any], list[str]]]:
    """What subschema ``s`` (at ``where``) requires: a list of OR groups (subschemas, their pointers), each of which
    must have a satisfiable member."""
    out: list[tuple[list[Any], list[str]]] = []
    if isinstance(s.get("$ref"), str):
        target = _resolve(root, s["$ref"])
        if target is not _UNKNOWN:
            out.append(([target], [s["$ref"]]))
    for key, any_of in (("allOf", False), ("anyOf", True), ("oneOf", True)):
        subs = s.get(key)
        if isinstance(subs, list) and subs:
            pairs = [(x, f"{where}/{key}/{i}") for i, x in enumerate(subs) if isinstance(x, dict | bool)]
            groups = [pairs] if any_of else [[p] for p in pairs]
            out += [([x for x, _ in g], [w for _, w in g]) for g in groups if g]
    kind = s.get("type")
    if kind == "object":
        props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
        for name in s.get("required") or ():
            if isinstance(name, str) and isinstance(props.get(name), dict | bool):
                out.append(([props[name]], [f"{where}/properties/{_escape(name)}"]))
    elif kind == "array":
        least = s.get("minItems")
        least = least if isinstance(least, int) and not isinstance(least, bool) else 0
        prefix = s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else []
        for i, x in enumerate(prefix[:least]):
            if isinstance(x, dict | bool):
                out.append(([x], [f"{where}/prefixItems/{i}"]))
        if least > len(prefix) and isinstance(s.get("items"), dict | bool):
            out.append(([s["items"]], [f"{where}/items"]))
    return out


def _least_fixed_point(needs: dict[int, list[list[int]]]) -> set[int]:
    """The nodes that are satisfiable: those all of whose OR groups have a satisfiable member, found by propagation
    from the nodes that need nothing (linear in the edges)."""
    waiting = {i: len(groups) for i, groups in needs.items()}  # OR groups not yet met
    users: dict[int, list[tuple[int, int]]] = {}  # member -> [(node, group index)]
    for i, groups in needs.items():
        for g, group in enumerate(groups):
            for member in group:
                users.setdefault(member, []).append((i, g))
    met: set[int] = set()
    group_met: set[tuple[int, int]] = set()
    ready = [i for i, n in waiting.items() if n == 0]
    while ready:
        i = ready.pop()
        if i in met:
            continue
        met.add(i)
        for node, g in users.get(i, ()):
            if (node, g) not in group_met:
                group_met.add((node, g))
                waiting[node] -= 1
                if waiting[node] == 0:
                    ready.append(node)
    return met


_UNKNOWN = object()


def _resolve(root: dict, ref: str) -> Any:
    """The subschema a local ``$ref`` (``#``, ``#/$defs/a``) names in ``root``, or ``_UNKNOWN``."""
    if not ref.startswith("#") or (len(ref) > 1 and not ref.startswith("#/")):
        return _UNKNOWN
    node: Any = root
    for raw in ref[2:].split("/") if len(ref) > 1 else ():
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _UNKNOWN
    return node if isinstance(node, dict | bool) else _UNKNOWN


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
