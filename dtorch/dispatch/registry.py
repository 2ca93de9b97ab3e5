"""The ``Dispatcher``: a thread-safe registry of kernel candidates per ``KernelKey``.

Each key holds an ordered list of candidates (provider, priority, meta, optional capability
check). The winner for a call is the highest-priority candidate that is not disabled and whose
check accepts the call; ties go to the later registration. ``explain`` says why.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from dtorch.core import env
from dtorch.core.dtypes import dtype_name
from dtorch.core.errors import KernelNotFound, RegistrationError
from dtorch.dispatch import verification
from dtorch.dispatch.context import KernelContext
from dtorch.dispatch.key import KernelKey
from dtorch.dispatch.meta import DEFAULT_META, Call, Check, KernelMeta

KernelFn = Callable[[KernelContext, Sequence[torch.Tensor], Sequence[torch.Tensor]], None]
FunctionalFn = Callable[[KernelContext, Sequence[torch.Tensor]], tuple]

# Default priority per provider when a registration names none; reference kernels always lose.
PROVIDER_PRIORITY = {"reference": 0, "torch": 10, "blas": 20, "sdpa": 20, "fused": 20, "triton": 30, "user": 100}

# Backends whose kernels are registered on the first lookup that misses: device type -> "module:function".
DEFAULT_BACKENDS = {"cpu": "dtorch.kernels:install_cpu", "cuda": "dtorch.kernels:install_cuda",
                    "meta": "dtorch.kernels:install_meta"}


def _origin(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


@dataclass(frozen=True, slots=True)
class Candidate:
    """One registered implementation of a key."""

    fn: KernelFn
    provider: str
    priority: int
    meta: KernelMeta
    check: Check | None
    seq: int  # registration order, newer wins ties
    # Optional allocating form of the same kernel, ``functional(ctx, inputs) -> tuple of outputs``, used by
    # the functional op wrappers: torch's allocating calls skip the out= checks and cost ~1 us less.
    functional: FunctionalFn | None = None

    @property
    def name(self) -> str:
        return f"{self.provider}:{_origin(self.fn)}"


@dataclass(frozen=True, slots=True)
class Choice:
    """The result of choosing for one call: the winner and why each other candidate lost."""

    key: KernelKey
    winner: Candidate
    passed_over: tuple[tuple[Candidate, str], ...]


@dataclass(frozen=True, slots=True)
class Explanation:
    """Every candidate of a key, in order, with the winner marked and a reason for each other."""

    key: KernelKey
    rows: tuple[tuple[Candidate, str], ...]  # (candidate, "active" or why it was passed over)
    winner: Candidate | None

    def __str__(self) -> str:
        lines = [f"{self.key}: {len(self.rows)} candidate(s)"]
        for cand, status in self.rows:
            mark = "*" if cand is self.winner else " "
            lines.append(f" {mark} {cand.provider:<10} priority {cand.priority:<4} {_origin(cand.fn)}  [{status}]"
                         f"  meta: {cand.meta.describe()}")
        if self.winner is None:
            lines.append("   no candidate accepts this call")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class TableRow:
    key: KernelKey
    provider: str
    priority: int
    active: bool
    origin: str
    meta: KernelMeta = field(default=DEFAULT_META)


class Dispatcher:
    """Kernel registry and selector. ``dtorch.dispatcher`` is the process-wide instance."""

    def __init__(self, backends: dict[str, str | Callable[[Dispatcher], None]] | None = None) -> None:
        self._lock = threading.RLock()
        self._candidates: dict[KernelKey, list[Candidate]] = {}
        self._fast: dict[KernelKey, Candidate] = {}  # winners of keys without checks, valid for this generation
        self._seq = itertools.count()
        self._disabled: dict[str, int] = defaultdict(int)  # provider -> nesting count
        self._env_disabled = env.disabled_providers()
        self.generation = 0
        self._backends = dict(DEFAULT_BACKENDS if backends is None else backends)
        self._backend_lock = threading.RLock()  # a loader may load another backend (meta loads cpu)
        self._loaded: set[str] = set()
        self.backend_loads: dict[str, int] = defaultdict(int)
        self._watchers: weakref.WeakSet = weakref.WeakSet()  # prepared kernels to re-bind on every change
        verification.add_listener(self._changed)

    # -- registration ------------------------------------------------------------------------

    def register(self, key: KernelKey, fn: KernelFn, *, provider: str = "reference", priority: int | None = None,
                 meta: KernelMeta | None = None, check: Check | None = None, override: bool = False,
                 functional: FunctionalFn | None = None) -> Candidate:
        """Add ``fn`` as a candidate for ``key``.

        Registering the same function again for the same (key, provider) is a no-op; a different
        function for the same (key, provider) raises ``RegistrationError`` unless ``override=True``.
        """
        if not isinstance(key, KernelKey):
            raise RegistrationError(f"register: key must be a KernelKey, got {type(key).__name__}")
        if not callable(fn):
            raise RegistrationError(f"register {key}: kernel must be callable, got {type(fn).__name__}")
        prio = PROVIDER_PRIORITY.get(provider, 10) if priority is None else int(priority)
        with self._lock:
            cands = self._candidates.setdefault(key, [])
            for i, old in enumerate(cands):
                if old.provider != provider:
                    continue
                if (old.fn is fn and old.priority == prio and old.check is check and old.functional is functional
                        and (meta is None or meta == old.meta)):
                    return old
                if not override:
                    raise RegistrationError(
                        f"register {key}: provider {provider!r} already has {_origin(old.fn)}; "
                        f"refusing to replace it with {_origin(fn)} silently (pass override=True)")
                del cands[i]
                break
            cand = Candidate(fn, provider, prio, meta or DEFAULT_META, check, next(self._seq), functional)
            cands.append(cand)
            cands.sort(key=lambda c: (-c.priority, -c.seq))
            self._changed()
            return cand

    def unregister(self, key: KernelKey, provider: str) -> None:
        """Remove ``provider``'s candidate for ``key``; raises ``KernelNotFound`` if it has none."""
        with self._lock:
            cands = self._candidates.get(key, [])
            kept = [c for c in cands if c.provider != provider]
            if len(kept) == len(cands):
                raise KernelNotFound(f"unregister: {key} has no candidate from provider {provider!r}")
            self._candidates[key] = kept
            self._changed()

    def _changed(self) -> None:
        with self._lock:
            self._fast = {}
            self.generation += 1
            for watcher in list(self._watchers):
                watcher.rebind()

    def watch(self, prepared) -> None:
        """Re-bind ``prepared`` (anything with ``rebind()``) whenever the registry or verify mode changes."""
        with self._lock:
            self._watchers.add(prepared)

    @contextlib.contextmanager
    def disabled(self, *providers: str) -> Iterator[None]:
        """Within the block, candidates of ``providers`` are never chosen (for A/B runs).

        Prepared kernels notice the generation change and re-choose on their next call.
        """
        with self._lock:
            for p in providers:
                self._disabled[p] += 1
            self._changed()
        try:
            yield
        finally:
            with self._lock:
                for p in providers:
                    self._disabled[p] -= 1
                    if not self._disabled[p]:
                        del self._disabled[p]
                self._changed()

    def is_disabled(self, provider: str) -> bool:
        return provider in self._disabled or provider in self._env_disabled

    # -- lazy backends ------------------------------------------------------------------------

    def add_backend(self, device_type: str, loader: str | Callable[[Dispatcher], None]) -> None:
        """Register ``loader`` to run once, on the first lookup that misses on ``device_type``."""
        with self._backend_lock:
            self._backends[device_type] = loader

    def ensure_backend(self, device_type: str) -> None:
        """Run ``device_type``'s loader exactly once per dispatcher, even under contention."""
        if device_type in self._loaded:
            return
        with self._backend_lock:
            if device_type in self._loaded:
                return
            loader = self._backends.get(device_type)
            if loader is not None:
                if isinstance(loader, str):
                    module, _, name = loader.partition(":")
                    loader = getattr(importlib.import_module(module), name)
                self.backend_loads[device_type] += 1
                loader(self)
            self._loaded.add(device_type)

    # -- lookup --------------------------------------------------------------------------------

    def _cands(self, key: KernelKey) -> list[Candidate]:
        cands = self._candidates.get(key)
        if cands is None and key.device not in self._loaded:
            self.ensure_backend(key.device)
            cands = self._candidates.get(key)
        return cands or []

    def choose(self, key: KernelKey, call: Call | None = None) -> Choice:
        """Pick the winner for ``key`` (and the call's static facts, when given).

        A check is evaluated only when ``call`` is given. Raises ``KernelNotFound`` listing what is
        registered for the op when no candidate exists or none accepts.
        """
        cands = self._cands(key)
        passed: list[tuple[Candidate, str]] = []
        winner = None
        for cand in cands:
            reason = self._reason(cand, call) if winner is None else f"lower priority than {winner.provider}"
            if reason is None:
                winner = cand
            else:
                passed.append((cand, reason))
        if winner is None:
            raise KernelNotFound(self._not_found(key, passed))
        return Choice(key, winner, tuple(passed))

    def select(self, key: KernelKey, call: Call | None = None) -> Candidate:
        """The winning candidate; keys without checks are answered from a per-generation cache."""
        cand = self._fast.get(key)
        if cand is not None:
            return cand
        generation = self.generation
        choice = self.choose(key, call)
        cands = self._candidates.get(key, ())
        if all(c.check is None for c in cands):
            with self._lock:
                if generation == self.generation:  # no registration raced with this choice
                    self._fast[key] = choice.winner
        return choice.winner

    def needs_call(self, key: KernelKey) -> bool:
        """True when some candidate of ``key`` has a capability check (so choices depend on the call)."""
        return any(c.check is not None for c in self._cands(key))

    def _reason(self, cand: Candidate, call: Call | None) -> str | None:
        if self.is_disabled(cand.provider):
            return f"provider {cand.provider!r} disabled"
        if cand.check is not None and call is not None:
            return cand.check(call)
        return None

    def lookup(self, key: KernelKey, call: Call | None = None) -> KernelFn:
        """The winning kernel function for ``key``; raises ``KernelNotFound``."""
        return self.select(key, call).fn

    def lookup_meta(self, key: KernelKey, call: Call | None = None) -> KernelMeta:
        return self.select(key, call).meta

    def has_kernel(self, key: KernelKey, call: Call | None = None) -> bool:
        try:
            self.select(key, call)
        except KernelNotFound:
            return False
        return True

    def candidates(self, key: KernelKey) -> tuple[Candidate, ...]:
        """Every candidate of ``key``, winner order first."""
        return tuple(self._cands(key))

    def explain(self, key: KernelKey, call: Call | None = None) -> Explanation:
        """Every candidate of ``key`` with its status: active, or why it was passed over."""
        cands = self._cands(key)
        rows: list[tuple[Candidate, str]] = []
        winner = None
        for cand in cands:
            reason = self._reason(cand, call)
            if reason is None and winner is None:
                winner = cand
                status = "active"
                if cand.check is not None and call is None:
                    status = "active (its capability check was not run: no call facts given)"
            elif reason is None:
                status = f"lower priority than {winner.provider}" if winner else "?"
            else:
                status = reason
            rows.append((cand, status))
        return Explanation(key, tuple(rows), winner)

    # -- introspection -------------------------------------------------------------------------

    def ops(self, device: str | None = None) -> list[str]:
        """Op names that have any registration (on ``device`` if given), sorted."""
        if device is not None:
            self.ensure_backend(device)
        with self._lock:
            return sorted({k.op for k in self._candidates if device is None or k.device == device})

    def keys(self) -> list[KernelKey]:
        with self._lock:
            return sorted(self._candidates, key=lambda k: (k.op, k.device, dtype_name(k.dtype), k.layout))

    def table(self, device: str | None = None) -> list[TableRow]:
        """One row per registration; ``active`` marks the winner of its key (without call facts)."""
        if device is not None:
            self.ensure_backend(device)
        rows = []
        for key in self.keys():
            if device is not None and key.device != device:
                continue
            exp = self.explain(key)
            for cand, _ in exp.rows:
                rows.append(TableRow(key, cand.provider, cand.priority, cand is exp.winner, _origin(cand.fn),
                                     cand.meta))
        return rows

    def _not_found(self, key: KernelKey, passed: list[tuple[Candidate, str]]) -> str:
        if passed:
            why = "; ".join(f"{c.provider} declined: {r}" for c, r in passed)
            return f"no kernel for {key.op} on {key.device}/{dtype_name(key.dtype)} accepts this call ({why})"
        by_dev: dict[str, list[str]] = defaultdict(list)
        with self._lock:
            for k in self._candidates:
                if k.op == key.op and self._candidates[k]:
                    by_dev[k.device].append(dtype_name(k.dtype))
        if not by_dev:
            near = [op for op in self.ops() if op.split(".")[-1] == key.op.split(".")[-1]]
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            where = f"{key.device}/{dtype_name(key.dtype)}"
            return f"no kernel for {key.op} on {where}: op {key.op!r} is not registered{hint}"
        registered = ", ".join(f"{d}/{{{','.join(sorted(v))}}}" for d, v in sorted(by_dev.items()))
        return f"no kernel for {key.op} on {key.device}/{dtype_name(key.dtype)}; registered: {registered}"
