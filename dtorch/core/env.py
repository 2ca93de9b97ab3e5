"""Every environment flag dtorch reads, in one place.

| flag | meaning | default |
|---|---|---|
| DTORCH_VERIFY | run the reference kernel beside the active one and compare | off |
| DTORCH_DISABLE_PROVIDERS | comma-separated providers never chosen ("blas,sdpa") | none |
| DTORCH_SYNC_TIMEOUT | seconds a stream synchronization waits before raising | 300 |
| DTORCH_THREADS | intra-op threads per CPU device stream (0: share the cores fairly) | 0 |
| DTORCH_TRACE | record every kernel's start and end on its stream | off |
"""

from __future__ import annotations

import os


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def verify() -> bool:
    return _flag("DTORCH_VERIFY")


def disabled_providers() -> frozenset[str]:
    raw = os.environ.get("DTORCH_DISABLE_PROVIDERS", "")
    return frozenset(p.strip() for p in raw.split(",") if p.strip())


def sync_timeout() -> float:
    return float(os.environ.get("DTORCH_SYNC_TIMEOUT", "300"))


def threads_per_device() -> int:
    return int(os.environ.get("DTORCH_THREADS", "0"))


def trace() -> bool:
    return _flag("DTORCH_TRACE")
