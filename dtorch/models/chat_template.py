"""Chat templates: jinja2 in an immutable sandbox, bounded in time, value size and output size.

A chat template comes from a model file (a GGUF's ``tokenizer.chat_template``, ``tokenizer_config.json``), so it is
untrusted code. jinja2's sandbox only stops unsafe attribute access; here every loop step, call, attribute access
and filter also checks a deadline, operators and string methods that grow values refuse results past a size bound
before making them, all values made are charged against an allocation budget, and the output is capped.
``render(source, where, context, input_chars)`` raises ``ModelError`` naming ``where`` and the bound.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from dtorch.core.errors import ArgumentError, ModelError

TIME_LIMIT_S = 5.0  # seconds of one render
MAX_CHARS = 1 << 24  # the output and any one value, plus 4x the messages' size
ALLOC_FACTOR = 8  # all values made in one render: this many times the value bound
MAX_INT_BITS = 1 << 16  # integers a template makes
_HUGE_WIDTH = re.compile(r"\d{7,}")  # a width or precision of 10**6 or more in a format string


class TemplateBound(Exception):
    """A render went past one of its bounds."""


class _Raised(Exception):
    """``raise_exception(...)`` called from a chat template."""


class _Budget:
    def __init__(self, limit: int) -> None:
        self.deadline = time.monotonic() + TIME_LIMIT_S
        self.limit = limit
        self.left = limit * ALLOC_FACTOR


_local = threading.local()


def _tick() -> None:
    if time.monotonic() > _local.budget.deadline:
        raise TemplateBound(f"it ran past the time limit of {TIME_LIMIT_S} s")


def _charge(n: int, what: str) -> None:
    """Account for a value of ``n`` characters or items about to be made by ``what``."""
    b = _local.budget
    if n > b.limit:
        raise TemplateBound(f"{what} would make a value of {n} characters or items, over the bound of {b.limit}")
    b.left -= n
    if b.left < 0:
        raise TemplateBound(f"it made more than {b.limit * ALLOC_FACTOR} characters or items of values in all")


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple, dict, set, frozenset)) else 0


def _check_ints(args: tuple, kwargs: Mapping[str, Any], what: str) -> None:
    """Refuse an int argument as large as the value bound (a width, a count)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and abs(a) > _local.budget.limit:
            raise TemplateBound(f"{what} got the argument {a}, over the bound of {_local.budget.limit}")


def _check_format(fmt: str, what: str) -> None:
    if _HUGE_WIDTH.search(fmt):
        raise TemplateBound(f"{what} has a format width or precision of 10**6 or more")


def _grown(name: str, value: Any, args: tuple, kwargs: Mapping[str, Any]) -> int | None:
    """Characters of a string op's result, computed before making it, for the ops that can grow a string."""
    if name == "replace" and isinstance(value, str) and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        old, new = args[0], args[1]
        return len(value) + (value.count(old) if old else len(value) + 1) * max(len(new) - len(old), 0)
    if name == "join" and isinstance(value, (list, tuple)):
        sep = args[0] if args and isinstance(args[0], str) else ""
        return sum(len(str(v)) for v in value) + len(sep) * len(value)
    if name in ("indent", "wordwrap") and isinstance(value, str):  # a string inserted at each line
        extra = sum(len(a) for a in (*args, *kwargs.values()) if isinstance(a, str))
        return len(value) + (value.count("\n") + 1 + (len(value) if name == "wordwrap" else 0)) * extra
    return None


class _Bounded:
    """Mixin for the sandbox: the checks of every call, attribute access and intercepted operator."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _tick()
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "**" and ints and right > 0 and abs(left) > 1 and left.bit_length() * right > MAX_INT_BITS:
            raise TemplateBound(f"'**' would make an integer of about {left.bit_length() * right} bits, over "
                                f"{MAX_INT_BITS}")
        if operator == "*":
            if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateBound(f"'*' would make an integer of more than {MAX_INT_BITS} bits")
            for seq, n in ((left, right), (right, left)):
                if isinstance(n, int) and _size(seq):
                    _charge(_size(seq) * max(n, 0), "'*'")
        if operator == "+" and _size(left) and _size(right):
            _charge(_size(left) + _size(right), "'+'")
        if operator == "%" and isinstance(left, str):
            _check_format(left, "'%'")
            _check_ints(right if isinstance(right, tuple) else (right,), {}, "'%'")
        out = super().call_binop(context, operator, left, right)  # type: ignore[misc]
        if operator == "%":
            _charge(_size(out), "'%'")
        return out

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)  # type: ignore[misc]

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)  # type: ignore[misc]

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        fmt = super().wrap_str_format(value)  # type: ignore[misc]
        if fmt is None:
            return None
        _check_format(value.__self__, "str.format")

        def bounded(*args: Any, **kwargs: Any) -> str:
            _check_ints(args, kwargs, "str.format")
            out = fmt(*args, **kwargs)
            _charge(len(out), "str.format")
            return out

        return bounded

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja2's names)
        _tick()
        if isinstance(getattr(__obj, "__self__", None), str):  # a str method: center, ljust, zfill, replace ...
            what = f"str.{getattr(__obj, '__name__', '?')}"
            _check_ints(args, kwargs, what)
            name = getattr(__obj, "__name__", "")
            if name == "join" and args:  # sep.join(items): the items once, as a list, to count them first
                args = (list(args[0]), *args[1:])
                grown = _grown("join", args[0], (__obj.__self__,), {})
            else:
                grown = _grown(name, __obj.__self__, args, kwargs)
            if grown is not None:
                _charge(grown, what)
        out = super().call(__context, __obj, *args, **kwargs)  # type: ignore[misc]
        _charge(_size(out), getattr(__obj, "__name__", "a call"))
        return out


def _bounded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """A jinja2 filter that checks the deadline, its int arguments and the size it makes."""

    @functools.wraps(f)  # keeps jinja2's pass_context / pass_eval_context marks
    def filt(*args: Any, **kwargs: Any) -> Any:
        _tick()
        value_at = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0
        value, rest = (args[value_at], args[value_at + 1:]) if len(args) > value_at else (None, ())
        _check_ints(rest, kwargs, f"the filter {name!r}")
        if name == "format" and isinstance(value, str):
            _check_format(value, "the filter 'format'")
        grown = _grown(name, value, rest, kwargs)
        if grown is not None:
            _charge(grown, f"the filter {name!r}")
        out = f(*args, **kwargs)
        _charge(_size(out), f"the filter {name!r}")
        return out

    return filt


def _steps(iterable: Any) -> Any:
    """Every loop iterates through this: each step checks the deadline."""
    for item in iterable:
        _tick()
        yield item


def _concat(parts: list[Any]) -> str:
    """``a ~ b``: the characters are charged before the string is made."""
    strs = [str(p) for p in parts]
    _charge(sum(map(len, strs)), "'~'")
    return "".join(strs)


def _raise_exception(message: str) -> None:
    raise _Raised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.cache
def _environment() -> Any:
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    class Rewrite(NodeTransformer):
        """Loops iterate through ``_dtorch_steps``; ``a ~ b`` goes through ``_dtorch_concat``."""

        def visit_For(self, node: Any) -> Any:
            node = self.generic_visit(node)
            node.iter = nodes.Filter(node.iter, "_dtorch_steps", [], [], None, None, lineno=node.lineno)
            return node

        def visit_Concat(self, node: Any) -> Any:
            node = self.generic_visit(node)
            return nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), "_dtorch_concat", [], [], None, None,
                                lineno=node.lineno)

    class Environment(_Bounded, ImmutableSandboxedEnvironment):
        def _parse(self, source: str, name: str | None, filename: str | None) -> Any:
            return Rewrite().visit(super()._parse(source, name, filename))

    env = Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.filters["_dtorch_steps"], env.filters["_dtorch_concat"] = _steps, _concat
    del env.globals["lipsum"]  # lorem ipsum of any size: nothing a chat template needs
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    return _environment().from_string(source)


def compile_template(source: str, where: str) -> Any:
    """The compiled template; a ``ModelError`` naming ``where`` (the file it came from) when it does not compile."""
    from jinja2.exceptions import TemplateError

    try:
        return _compile(source)
    except (TemplateError, RecursionError, MemoryError) as e:
        raise ModelError(f"{where}: the chat template does not compile ({e})") from None


def render(source: str, where: str, context: Mapping[str, Any], input_chars: int = 0) -> str:
    """The template ``source`` rendered over ``context``, within ``TIME_LIMIT_S`` seconds and an output of at most
    ``MAX_CHARS + 4 * input_chars`` characters (``input_chars``: the size of the messages).

    ``raise_exception`` in the template: ``ArgumentError`` (the messages are at fault); a bound passed or any other
    failure: ``ModelError`` naming ``where``, the template's file.
    """
    template = compile_template(source, where)
    outer = getattr(_local, "budget", None)
    _local.budget = budget = _Budget(MAX_CHARS + 4 * input_chars)
    out: list[str] = []
    size = 0
    try:
        for piece in template.generate(**context):
            size += len(piece)
            if size > budget.limit:
                raise TemplateBound(f"its output passed the bound of {budget.limit} characters")
            out.append(piece)
    except _Raised as e:
        raise ArgumentError(f"apply_chat_template: the model's template rejected the messages: {e}") from None
    except TemplateBound as e:
        raise ModelError(f"{where}: the chat template went past a bound: {e}; the template is not usable as is "
                         "(fix it in the model's files, or pass a raw prompt)") from None
    except (RecursionError, MemoryError) as e:
        raise ModelError(f"{where}: the chat template exhausted the process ({type(e).__name__})") from None
    except Exception as e:  # noqa: BLE001 - untrusted code: any failure is the template's
        raise ModelError(f"{where}: the chat template failed to render ({type(e).__name__}: {e})") from None
    finally:
        _local.budget = outer
    return "".join(out)


def read_template(path: str | Path) -> str:
    """A chat template file (``chat_template.jinja``) as text; ``ModelError`` naming it when it is not a regular
    file of UTF-8 text of at most ``MAX_CHARS`` bytes."""
    import os
    import stat

    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ModelError(f"{path}: a chat template must be a regular file, this is not")
        if st.st_size > MAX_CHARS:
            raise ModelError(f"{path}: the chat template has {st.st_size} bytes, over the bound of {MAX_CHARS}")
        with open(path, "rb") as f:
            data = f.read(MAX_CHARS + 1)
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelError(f"{path}: the chat template is not UTF-8 text ({e})") from None
    except OSError as e:
        raise ModelError(f"{path}: cannot read the chat template ({e.strerror or e})") from None
