"""The ``Dispatcher``: a thread-safe registry of kernel candidates per ``KernelKey``.

Each key holds an ordered list of candidates (provider, priority, meta, optional capability
check). The winner for a call is the highest-priority candidate that is not disabled and whose
check accepts the call; ties go to the later registration. ``explain`` says why.

Keys are checked at the door: an op must be defined first (a reference kernel defines its op, or
``define("family.op")``), the device type known, the dtype a ``torch.dtype``, the layout a known one.
A device type's backends load before the first registration or lookup on it, so a kernel registered
first thing still stands beside the built-ins. Backends that cannot load are recorded with the reason.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import math
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

from dtorch.core import cpu, env
from dtorch.core.device import DEVICE_TYPES, Device
from dtorch.core.dtypes import LAYOUTS, dtype_name
from dtorch.core.errors import ArgumentError, ConfigError, KernelNotFound, RegistrationError
from dtorch.dispatch import verification
from dtorch.dispatch.candidates import Candidate, Choice, Explanation, FunctionalFn, KernelFn, TableRow, _origin
from dtorch.dispatch.key import KernelKey, did_you_mean
from dtorch.dispatch.meta import DEFAULT_META, Call, Check, KernelMeta

Loader = Callable[["Dispatcher", str], None]  # loader(dispatcher, device_type) registers that device's backends

# The providers dtorch's backends register, with their default priority when a registration names none;
# reference kernels always lose. Any other name may be registered; these are what DTORCH_DISABLE_PROVIDERS
# accepts, and what ``disabled`` accepts besides the names already registered (a typo gets "did you mean").
PROVIDER_PRIORITY = {"reference": 0, "gathered": 5, "torch": 10, "chunked": 10, "blas": 20, "sdpa": 20, "onednn": 22,
                     "upcast": 25,
                     "triton": 30, "native": 30, "fla": 35, "user": 100}

# The loader that registers a device type's backends, run once before its first registration or lookup.
DEFAULT_BACKENDS = {"cpu": "dtorch.kernels:install", "cuda": "dtorch.kernels:install"}


class Dispatcher:
    """Kernel registry and selector. ``dtorch.dispatcher`` is the process-wide instance."""

    def __init__(self, backends: dict[str, str | Loader] | None = None) -> None:
        self._lock = threading.RLock()
        self._candidates: dict[KernelKey, list[Candidate]] = {}
        self._fast: dict[KernelKey, Candidate] = {}  # winners of keys without checks, valid for this generation
        self._seq = itertools.count()
        self._disabled: dict[str, int] = defaultdict(int)  # provider -> nesting count
        self._env_disabled = env.disabled_providers()
        unknown = sorted(self._env_disabled - set(PROVIDER_PRIORITY))
        if unknown:
            hints = [h for h in (did_you_mean(p, PROVIDER_PRIORITY) for p in unknown) if h]
            raise ConfigError(f"DTORCH_DISABLE_PROVIDERS names unknown provider(s) {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(PROVIDER_PRIORITY))}" + "".join(f"; {h}" for h in hints))
        self.generation = 0
        self._ops: set[str] = set()
        self._backends = dict(DEFAULT_BACKENDS if backends is None else backends)
        self._backend_lock = threading.RLock()  # one load per device type, even under contention
        self._loaded: set[str] = set()
        self._loading: set[str] = set()
        self._unavailable: dict[str, dict[str, str]] = defaultdict(dict)  # device -> backend -> reason
        self.backend_loads: dict[str, int] = defaultdict(int)
        self._watchers: weakref.WeakSet = weakref.WeakSet()  # prepared kernels to re-bind on every change
        verification.add_listener(self._changed)
        cpu.add_listener(self._changed)  # a forced CPU probe answer changes capability checks

    def __repr__(self) -> str:
        with self._lock:
            n_keys, n_cands = len(self._candidates), sum(map(len, self._candidates.values()))
            loaded = ", ".join(sorted(self._loaded)) or "none yet"
            off = sorted(set(self._disabled) | self._env_disabled)
        return (f"Dispatcher({len(self._ops)} ops, {n_keys} keys, {n_cands} kernels; backends loaded on: {loaded}"
                + (f"; disabled: {', '.join(off)}" if off else "") + ")")

    # -- ops -----------------------------------------------------------------------------------

    def define(self, op: str) -> str:
        """Declare ``op`` ("family.name") so kernels may be registered for it; defining it again is a no-op."""
        if not isinstance(op, str) or op.count(".") < 1 or op.startswith(".") or op.endswith(".") or " " in op:
            raise RegistrationError(f"define: an op name looks like 'family.name' (e.g. 'myfamily.op'), got {op!r}")
        with self._lock:
            self._ops.add(op)
        return op

    def is_defined(self, op: str) -> bool:
        return op in self._ops

    def _op_hint(self, op: str) -> str:
        """"did you mean" for an unknown ``op``: close names, or ops of the same name in another family."""
        with self._lock:
            ops = set(self._ops) | {k.op for k in self._candidates}
        near = sorted(o for o in ops if o.split(".")[-1] == op.split(".")[-1])
        return did_you_mean(op, ops) or (f"did you mean {' or '.join(map(repr, near))}?" if near else "")

    def _providers(self) -> set[str]:
        with self._lock:
            return set(PROVIDER_PRIORITY) | {c.provider for cands in self._candidates.values() for c in cands}

    def _check_key(self, key: object) -> KernelKey:
        if not isinstance(key, KernelKey):
            raise RegistrationError(f"register: key must be a KernelKey, got {type(key).__name__}")
        if not isinstance(key.dtype, torch.dtype):
            raise RegistrationError(f"register {key.op}: dtype must be a torch.dtype (e.g. torch.float32), got "
                                    f"{key.dtype!r}; KernelKey.of(...) parses names")
        if key.device not in DEVICE_TYPES:
            raise RegistrationError(f"register {key.op}: device type must be one of {', '.join(DEVICE_TYPES)}, "
                                    f"got {key.device!r}")
        if key.layout not in LAYOUTS:
            raise RegistrationError(f"register {key.op}: layout {key.layout!r} has no kernels; known layouts: "
                                    f"{', '.join(LAYOUTS)}")
        if key.op not in self._ops:
            self.ensure_backend(key.device)  # the built-in backends define their ops
        if key.op not in self._ops:
            hint = self._op_hint(key.op)
            raise RegistrationError(f"register {key}: op {key.op!r} is not defined{f' ({hint})' if hint else ''}; "
                                    f"declare a new op first with dispatcher.define({key.op!r})")
        return key

    # -- registration ------------------------------------------------------------------------

    def register(self, key: KernelKey, fn: KernelFn, *, provider: str, priority: int | None = None,
                 meta: KernelMeta | None = None, check: Check | None = None, override: bool = False,
                 functional: FunctionalFn | None = None, varies: str | None = None) -> Candidate:
        """Add ``fn`` as a candidate for ``key`` from ``provider`` (your own kernels: ``"user"``, priority 100).

        The key's device type loads its backends first, so registration order does not matter. Registering
        the same function again for the same (key, provider) is a no-op; a different function for the same
        (key, provider) raises ``RegistrationError`` unless ``override=True``. ``varies`` says in a few words
        how the kernel's path depends on the call (shown by ``explain`` and ``table``).
        """
        self._check_key(key)
        if not callable(fn):
            raise RegistrationError(f"register {key}: kernel must be callable, got {type(fn).__name__}")
        if not isinstance(provider, str) or not provider:
            raise RegistrationError(f"register {key}: provider must be a non-empty str, got {provider!r}")
        prio = PROVIDER_PRIORITY.get(provider, 10) if priority is None else check_priority(f"register {key}", priority)
        self.ensure_backend(key.device)
        with self._lock:
            cands = self._candidates.setdefault(key, [])
            for i, old in enumerate(cands):
                if old.provider != provider:
                    continue
                if (old.fn is fn and old.priority == prio and old.check is check and old.functional is functional
                        and old.varies == varies and (meta is None or meta == old.meta)):
                    return old
                if not override:
                    raise RegistrationError(
                        f"register {key}: provider {provider!r} already has {_origin(old.fn)}; "
                        f"refusing to replace it with {_origin(fn)} silently (pass override=True)")
                del cands[i]
                break
            cand = Candidate(fn, provider, prio, meta or DEFAULT_META, check, next(self._seq), functional, varies)
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
                have = [c.provider for c in cands]
                hint = did_you_mean(provider, have)
                raise KernelNotFound(f"unregister: {key} has no candidate from provider {provider!r}; it has "
                                     f"{', '.join(have) or 'none'}" + (f"; {hint}" if hint else ""))
            if kept:
                self._candidates[key] = kept
            else:
                del self._candidates[key]  # no empty keys: every listed key has a winner to explain
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

        Prepared kernels notice the generation change and re-choose on their next call. An unknown provider
        name is an ``ArgumentError`` (a typo would otherwise disable nothing).
        """
        known = self._providers()
        for p in providers:
            if p not in known:
                hint = did_you_mean(p, known)
                raise ArgumentError(f"disabled: unknown provider {p!r}; known: {', '.join(sorted(known))}"
                                    + (f"; {hint}" if hint else ""))
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

    # -- backends -----------------------------------------------------------------------------

    def add_backend(self, device_type: str, loader: str | Loader) -> None:
        """Register ``loader`` to run once, before the first registration or lookup on ``device_type``."""
        with self._backend_lock:
            self._backends[device_type] = loader

    def ensure_backend(self, device_type: str) -> None:
        """Run ``device_type``'s loader exactly once per dispatcher, even under contention.

        Registrations the loader makes (and lookups on other threads) wait for it; a registration from the
        loader itself goes straight in.
        """
        if device_type in self._loaded:
            return
        with self._backend_lock:
            if device_type in self._loaded or device_type in self._loading:
                return
            loader = self._backends.get(device_type)
            self._loading.add(device_type)
            try:
                if loader is not None:
                    if isinstance(loader, str):
                        module, _, name = loader.partition(":")
                        loader = getattr(importlib.import_module(module), name)
                    self.backend_loads[device_type] += 1
                    loader(self, device_type)
                self._loaded.add(device_type)
            finally:
                self._loading.discard(device_type)

    def mark_unavailable(self, device_type: str, backend: str, reason: str) -> None:
        """Record that ``backend`` registered nothing on ``device_type``, and why (shown by explain and table)."""
        with self._lock:
            self._unavailable[device_type][backend] = reason

    def unavailable(self, device_type: str) -> dict[str, str]:
        """Backends that could not load on ``device_type``: {name: reason}."""
        self.ensure_backend(device_type)
        with self._lock:
            return dict(self._unavailable.get(device_type, {}))

    # -- lookup --------------------------------------------------------------------------------

    def _cands(self, key: KernelKey) -> list[Candidate]:
        cands = self._candidates.get(key)
        if cands is None and key.device not in self._loaded:
            self.ensure_backend(key.device)
            cands = self._candidates.get(key)
        if cands is None and key.device == "meta":
            cands = self._meta_mirror(key)
        return cands or []

    def _meta_mirror(self, key: KernelKey) -> list[Candidate] | None:
        """Meta tensors carry no data, so any op with a CPU kernel runs on meta as a shape-only kernel."""
        cpu_cands = self._cands(KernelKey(key.op, "cpu", key.dtype, key.layout))
        if not cpu_cands:
            return None
        with self._lock:
            cand = Candidate(_shape_only, "reference", 0, cpu_cands[0].meta, None, next(self._seq))
            return self._candidates.setdefault(key, [cand])

    def choose(self, key: KernelKey, call: Call | None = None) -> Choice:
        """Pick the winner for ``key`` and the call's static facts.

        Without ``call``, checks see a call with only the key's device and dtype known (as a prepared
        operator that knows nothing more does), so what depends on the machine or the key is decided.
        Raises ``KernelNotFound`` listing what is registered for the op when no candidate accepts.
        """
        cands = self._cands(key)
        call = call or _bare_call(key)
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
        captured = call is not None and call.capture  # a captured call's winner may differ: never cached
        cand = None if captured else self._fast.get(key)
        if cand is not None:
            return cand
        generation = self.generation
        choice = self.choose(key, call)
        cands = self._candidates.get(key, ())
        if all(c.check is None for c in cands) and not captured:
            with self._lock:
                if generation == self.generation:  # no registration raced with this choice
                    self._fast[key] = choice.winner
        return choice.winner

    def needs_call(self, key: KernelKey) -> bool:
        """True when some candidate of ``key`` has a capability check (so choices depend on the call)."""
        return any(c.check is not None for c in self._cands(key))

    def _reason(self, cand: Candidate, call: Call) -> str | None:
        if self.is_disabled(cand.provider):
            return f"provider {cand.provider!r} disabled"
        if call.capture and not cand.meta.capture_safe:
            return "not capture-safe (reads device values on the host), and this call is captured"
        if cand.check is not None:
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

    def reference(self, key: KernelKey) -> Candidate | None:
        """The key's reference candidate (what verify compares with), disabled or not."""
        return next((c for c in self._cands(key) if c.provider == "reference"), None)

    def explain(self, key: KernelKey, call: Call | None = None) -> Explanation:
        """Every candidate of ``key`` with its status: active, or why it was passed over.

        Without ``call`` the checks see the key's device and dtype only, as ``choose`` does; a winner whose
        path still depends on the call's shapes says so. An op that is not defined raises ``KernelNotFound``.
        """
        cands = self._cands(key)
        if not cands and key.op not in self._ops:
            raise KernelNotFound(self._not_found(key, []))  # a misspelled op: say which ones are close
        facts = call or _bare_call(key)
        rows: list[tuple[Candidate, str]] = []
        winner = None
        for cand in cands:
            reason = self._reason(cand, facts)
            if reason is None and winner is None:
                winner = cand
                status = "active"
                if cand.check is not None and facts.inputs is None:
                    status = "active (for calls its capability check accepts; shapes not given)"
            elif reason is None:
                status = f"lower priority than {winner.provider}" if winner else "?"
            else:
                status = reason
            rows.append((cand, status))
        with self._lock:
            unavailable = tuple(sorted(self._unavailable.get(key.device, {}).items()))
        return Explanation(key, tuple(rows), winner, unavailable)

    # -- introspection -------------------------------------------------------------------------

    def ops(self, device: str | None = None) -> list[str]:
        """Op names that have any registration (on ``device`` if given), sorted."""
        if device is not None:
            self.ensure_backend(device)
        with self._lock:
            return sorted({k.op for k in self._candidates if device is None or k.device == device})

    def keys(self, device: str | None = None) -> list[KernelKey]:
        """Every registered key (of ``device`` if given; its backends load first), sorted."""
        for dev in [device] if device is not None else list(self._backends):
            self.ensure_backend(dev)
        with self._lock:
            keys = [k for k in self._candidates if device is None or k.device == device]
        return sorted(keys, key=lambda k: (k.op, k.device, dtype_name(k.dtype), k.layout))

    def table(self, device: str | None = None) -> list[TableRow]:
        """One row per registration; ``active`` marks what ``choose`` picks for the key without call facts."""
        rows = []
        for key in self.keys(device):
            exp = self.explain(key)
            for cand, _ in exp.rows:
                rows.append(TableRow(key, cand.provider, cand.priority, cand is exp.winner, _origin(cand.fn),
                                     cand.meta, cand.varies))
        return rows

    def _not_found(self, key: KernelKey, passed: list[tuple[Candidate, str]]) -> str:
        if passed:
            why = "; ".join(f"{c.provider} declined: {r}" for c, r in passed)
            return f"no kernel for {key.op} on {key.device}/{dtype_name(key.dtype)} accepts this call ({why})"
        by_dev: dict[str, list[str]] = defaultdict(list)
        with self._lock:
            for k in self._candidates:
                if k.op == key.op and self._candidates[k]:
                    by_dev[k.device].append(dtype_name(k.dtype) + ("" if k.layout == "strided" else f"/{k.layout}"))
            unavailable = dict(self._unavailable.get(key.device, {}))
        missing = "".join(f"; backend {b!r} unavailable: {r}" for b, r in sorted(unavailable.items()))
        where = f"{key.device}/{dtype_name(key.dtype)}" + ("" if key.layout == "strided" else f"/{key.layout}")
        if not by_dev:
            hint = self._op_hint(key.op)
            hint = f"; {hint}" if hint else ""
            return f"no kernel for {key.op} on {where}: op {key.op!r} is not registered{hint}{missing}"
        registered = ", ".join(f"{d}/{{{','.join(sorted(v))}}}" for d, v in sorted(by_dev.items()))
        return f"no kernel for {key.op} on {where}; registered: {registered}{missing}"


def check_priority(where: str, priority: object) -> int:
    """``priority`` as an int, or ``RegistrationError``: NaN and inf have no place in the order of candidates."""
    if isinstance(priority, bool) or not isinstance(priority, (int, float)) or not math.isfinite(priority) \
            or priority != int(priority):
        raise RegistrationError(f"{where}: priority must be a whole number (higher wins; 'user' is 100), "
                                f"got {priority!r}")
    return int(priority)


def _bare_call(key: KernelKey) -> Call:
    """The facts of a call when only its key is known."""
    return Call(Device(key.device), key.dtype)


def _shape_only(ctx, inputs, outputs) -> None:
    """Meta tensors carry no data: the wrapper already validated and allocated the outputs."""
