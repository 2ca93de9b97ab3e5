"""This process's memory mappings as /proc/self/smaps describes them (Linux), for tests of where tensors live."""

from __future__ import annotations


def mapping(address: int) -> tuple[int, int, dict[str, int]]:
    """(start, end, {field: KiB}) of the mapping that holds ``address``: its Rss, AnonHugePages, ... lines."""
    span, fields = None, {}
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            head = parts[0]
            if "-" in head and ":" not in head:  # a mapping's first line: "lo-hi perms ..."
                if span is not None:
                    break
                lo, hi = (int(v, 16) for v in head.split("-"))
                span = (lo, hi) if lo <= address < hi else None
            elif span is not None and head.endswith(":") and len(parts) > 1 and parts[1].isdigit():
                fields[head[:-1]] = int(parts[1])
    if span is None:
        raise AssertionError(f"no mapping holds {address:#x}")
    return (*span, fields)
