"""scripts/device-check.sh, read against the GPU machine's image: every import it needs is there or travels in
``.whl/``, its install line is the one ``../shared/tools/device-wheels.sh`` prints, and the README's device call runs
it. (The script itself runs on the CPU as ``--dry-run`` in CI, after the tests.)"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = (ROOT / "scripts" / "device-check.sh").read_text()
# import names of the packages the GPU machine's image has (the device tool's KINDS.md), and what .whl/ carries
IMAGE = {"torch", "triton", "transformers", "numpy", "safetensors", "tokenizers", "jinja2", "tqdm", "yaml", "requests",
         "prometheus_client", "pytest", "hypothesis"}
CARRIED = {"gguf"}
# imported off the check's path, only by the files named: not needed on the machine
_SERVE = ("dtorch/serve/",)  # the serve extra
OFF_PATH = {"matplotlib": ("dtorch/cli.py", "dtorch/runtime/tracing.py"),  # the trace's picture
            "fastapi": _SERVE, "starlette": _SERVE, "pydantic": _SERVE, "uvicorn": _SERVE, "prometheus_client": _SERVE,
            "h11": _SERVE,
            "llguidance": ("dtorch/engine/structured.py",),  # structured outputs only, imported when one is asked
            "xxhash": ("dtorch/models/pack_cache.py",)}  # optional: the pack cache checks with zlib's CRC-32 without it


def _needs() -> set[str]:
    m = re.search(r'^NEEDS="([^"]*)"$', SCRIPT, re.M)
    assert m, "scripts/device-check.sh has no NEEDS=\"...\" line"
    return set(m.group(1).split())


def _install_line() -> str:
    m = re.search(r"^INSTALL='([^']*)'$", SCRIPT, re.M)
    assert m, "scripts/device-check.sh has no INSTALL='...' line"
    return m.group(1)


def _imports(path: Path) -> set[str]:
    """Top-level names of the modules ``path`` imports anywhere (at module level or inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _checked_files() -> list[Path]:
    """dtorch, the two benchmarks, and the cuda-marked test modules with the test modules they import."""
    files = list((ROOT / "dtorch").rglob("*.py"))
    files += [ROOT / "bench" / n for n in ("device_check.py", "device_check_llm.py", "gpu_decode.py")]
    todo = [p for p in (ROOT / "tests").glob("test_*.py") if "pytest.mark.cuda" in p.read_text()]
    todo.append(ROOT / "tests" / "conftest.py")
    assert len(todo) > 1, "no test is marked cuda"
    seen: set[Path] = set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tests."):
                todo.append(ROOT / (node.module.replace(".", "/") + ".py"))
    return files + sorted(seen)


def test_every_import_of_the_check_is_on_the_image_or_carried():
    needs = _needs()
    assert needs - {"dtorch"} <= IMAGE | CARRIED, f"NEEDS names what neither the image nor .whl/ has: " \
        f"{sorted(needs - IMAGE - CARRIED - {'dtorch'})}"
    local = {"dtorch", "tests", "device_check_llm"}
    unlisted: dict[str, list[str]] = {}
    for path in _checked_files():
        rel = path.relative_to(ROOT).as_posix()
        for name in _imports(path) - set(sys.stdlib_module_names) - local - needs:
            if rel.startswith(OFF_PATH.get(name, ())):
                continue
            unlisted.setdefault(name, []).append(rel)
    assert not unlisted, f"imported but not in device-check.sh's NEEDS (add it there and, if the image lacks it, " \
        f"to the wheels): {unlisted}"


def test_the_install_line_is_device_wheels_and_the_readme_runs_the_script():
    line = _install_line() + " || exit;"
    readme = (ROOT / "README.md").read_text()
    assert line in readme, "the README's device call must start with the install line"
    call = readme[readme.index(line):].split("\n")[0]
    assert "bash scripts/device-check.sh" in call and '"carry": [".whl"]' in readme
    wheels = ROOT.parent / "shared" / "tools" / "device-wheels.sh"
    if not wheels.exists():
        pytest.skip(f"{wheels} is not on this machine: the install line is not compared with what it prints")
    printed = re.findall(r"^echo '(python3 -m pip install [^']*)'$", wheels.read_text(), re.M)
    assert printed == [line], f"device-wheels.sh prints {printed}, device-check.sh runs {line!r}"
