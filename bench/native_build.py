"""What the native build compiles, and how long it takes: a full build, a rebuild with nothing changed, and the
rebuilds after adding one op the way docs/adding-an-op.md says (its own group; or a row in an existing group).

Each build compiles a copy of ``dtorch/kernels/native/csrc`` (the op added to the copy) into a fresh object cache
in a temporary directory and links it; the toy op's library is then loaded in a child process and its op compared
with torch (the documented path, end to end).

    python bench/native_build.py            # the builds, timed (minutes: the full build compiles every object)
    python bench/native_build.py --smoke    # no compiling: which objects each change makes stale in the library's
                                            # own object cache, and the no-change rebuild (a relink) timed
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from dtorch.kernels.native import build
from dtorch.kernels.native.objcache import ObjectCache, Tree

TOY_ROW = ('DTN_OP(toy, toy_scale, "llm.rms_norm", "dtorch.kernels.torch.llm:rms_norm_torch", "inplace",\n'
           '       "x * w * eps into out", DTN_IN(x) DTN_VEC(w) DTN_OUT(out) DTN_F32(eps))\n')
TOY_KERNEL = textwrap.dedent("""\
    #pragma once
    template <class T>
    static void toy_rows(const dtn::toy_scale_args& a, int64_t r0, int64_t r1) {
      const T* w = static_cast<const T*>(a.w);
      for (int64_t r = r0; r < r1; ++r) {
        const T* x = static_cast<const T*>(a.x) + r * a.ld_x;
        T* o = static_cast<T*>(a.out) + r * a.ld_out;
        for (int64_t i = 0; i < a.D; ++i) st(o, i, ld(x, i) * ld(w, i) * a.eps);
      }
    }
    static void toy_scale(const dtn::toy_scale_args& a, int64_t r0, int64_t r1) {
      if (a.dt == F32) toy_rows<float>(a, r0, r1); else toy_rows<uint16_t>(a, r0, r1);
    }
""")


def add_group(csrc: Path) -> None:
    """The toy op as a group of its own: ops/toy.def, ops/toy.h and its line in ops.def."""
    (csrc / "ops" / "toy.def").write_text(TOY_ROW)
    (csrc / "ops" / "toy.h").write_text(TOY_KERNEL)
    text = (csrc / "ops.def").read_text()
    last = '#include "ops/softmax.def"\n'
    (csrc / "ops.def").write_text(text.replace(last, last + '#include "ops/toy.def"\n', 1))


def add_to_elementwise(csrc: Path) -> None:
    """The toy op in the elementwise group: its row in ops/elementwise.def, its kernel in ops/elementwise.h."""
    rows = csrc / "ops" / "elementwise.def"
    rows.write_text(rows.read_text() + TOY_ROW.replace("(toy,", "(elementwise,"))
    header = csrc / "ops" / "elementwise.h"
    body = TOY_KERNEL.replace("#pragma once\n", "")
    header.write_text(header.read_text() + body)


def timed_build(csrc: Path, objects: Path, lib: Path) -> tuple[list[str], int, float]:
    """(the objects compiled, the number of objects, seconds) for compiling csrc against the cache ``objects`` and
    linking."""
    cxx = build.compiler()
    start = time.perf_counter()
    res = ObjectCache(objects, cxx).build(build.units(csrc), Tree(csrc), os.cpu_count() or 1)
    build.link(cxx, res.objects, lib)
    return res.compiled, len(res.objects), time.perf_counter() - start


def stale(csrc: Path, objects: Path) -> tuple[list[str], int]:
    """The units of csrc whose object the cache lacks, and the number of units."""
    units, tree, cache = build.units(csrc), Tree(csrc), ObjectCache(objects, build.compiler())
    return [u.name for u in units if cache.cached(u, tree) is None], len(units)


def run_toy(lib: Path) -> str:
    """Load the library with the toy op in a child process and compare toy_scale with torch (float32, bfloat16)."""
    code = textwrap.dedent(f"""
        import torch
        from pathlib import Path
        from dtorch.kernels.native.build import import_library
        mod = import_library(Path({str(lib)!r}))
        worst = 0.0
        for dt in (torch.float32, torch.bfloat16):
            x, w = torch.randn(5, 96).to(dt), torch.randn(96).to(dt)
            out = torch.empty_like(x)
            mod.toy_scale(x[:, :96], w, out, 0.5)
            ref = (x.float() * w.float() * 0.5).to(dt)
            worst = max(worst, (out.float() - ref.float()).abs().max().item())
        print(worst)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    return p.stdout.strip() if p.returncode == 0 else f"failed: {p.stderr.strip()[-400:]}"


def table(rows: list[tuple[str, str, str]]) -> None:
    print("| build | objects compiled | seconds |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {' | '.join(r)} |")


def measure(tmp: Path) -> None:
    base = tmp / "base" / "csrc"
    shutil.copytree(build.CSRC, base)
    objects, lib = tmp / "objects", tmp / "lib.so"
    rows = []
    done, total, s = timed_build(base, objects, lib)
    rows.append(("full (an empty object cache)", f"{len(done)} of {total}", f"{s:.1f}"))
    done, total, s = timed_build(base, objects, lib)
    rows.append(("nothing changed (every object cached; relinked)", f"{len(done)} of {total}", f"{s:.1f}"))
    toy = "not run"
    for name, add in (("one op added as its own group", add_group),
                      ("one op added to the elementwise group", add_to_elementwise)):
        csrc = tmp / add.__name__ / "csrc"
        shutil.copytree(build.CSRC, csrc)
        add(csrc)
        toy_lib = tmp / f"{add.__name__}.so"
        done, total, s = timed_build(csrc, objects, toy_lib)
        rows.append((f"{name} ({', '.join(done)})", f"{len(done)} of {total}", f"{s:.1f}"))
        if add is add_group:
            toy = run_toy(toy_lib)
    table(rows)
    print(f"\ntoy_scale (the op added, loaded from its library) against torch, max |diff|: {toy}")


def smoke() -> None:
    objects = build.objects_dir()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        base = tmp / "base" / "csrc"
        shutil.copytree(build.CSRC, base)
        missing, total = stale(base, objects)
        if missing:
            rows.append(("nothing changed", f"{len(missing)} of {total} not cached (build the library first)", "-"))
        else:
            done, total, s = timed_build(base, objects, tmp / "lib.so")
            rows.append(("nothing changed (every object cached; relinked)", f"{len(done)} of {total}", f"{s:.1f}"))
        for name, add in (("one op added as its own group", add_group),
                          ("one op added to the elementwise group", add_to_elementwise)):
            csrc = tmp / add.__name__ / "csrc"
            shutil.copytree(build.CSRC, csrc)
            add(csrc)
            names, total = stale(csrc, objects)
            rows.append((f"{name} (stale: {', '.join(names)})", f"{len(names)} of {total}", "-"))
    table(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="no compiling: what each change makes stale")
    args = ap.parse_args(argv)
    if shutil.which(build.compiler()) is None:
        print(f"no C++ compiler {build.compiler()!r}: nothing to measure")
        table([])
        return 0
    if args.smoke:
        smoke()
    else:
        with tempfile.TemporaryDirectory() as d:
            measure(Path(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
