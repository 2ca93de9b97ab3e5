"""What one core of this machine can do at most, for reading the figures of ``bench/gguf_formats.py`` against.

    python bench/machine_limits.py [--repeats 5] [--threads 1 2] [--smoke]

Three probes, compiled here with the native build's compiler (``CXX``, default ``c++``) into a temporary directory and
run in a subprocess, medians of ``--repeats`` runs printed per thread count:
- **read**: 512 MiB streamed with 64-byte loads, four independent sums (no arithmetic to hide): the memory's ceiling
  for one-row decode, which reads every weight once per token; in the kernel's 4 KiB pages, and in 2 MiB pages
  (``madvise(MADV_HUGEPAGE)``, as ``LLM`` holds a model's weights: ``dtorch.core.memory.huge_pages``), where a
  stream pays no page walk every 4 KiB (on this EPYC VM one core reads ~1.6x as fast);
- **vpdpbusd**: 12 independent 512-bit accumulators, each step one ``vpdpbusd`` (64 int8 multiply-adds): the ceiling
  of any integer-dot-product kernel for prompts and batched decode on AVX-512 VNNI (needs the ``avx512_vnni`` CPU
  flag; skipped without it).

How to read them: a decode token reads the model's weight bytes once (for the 0.6B Q4_K_M file, ~395 MB), so
tok/s <= read GB/s / weight GB; a prompt of T tokens multiplies about T x (the layers' weights) int8 pairs, so
tok/s <= vpdpbusd GMAC/s / (GMAC per token). The issue's targets are ratios to llama.cpp on the same machine: where
the ratio times llama.cpp's own rate passes these ceilings, no kernel on this CPU reaches it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

__attribute__((target("avx512f,avx512bw"))) static double read_gbs(char* p, size_t n) {
  double t0 = omp_get_wtime();
  long long total = 0;
#pragma omp parallel reduction(+ : total)
  {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
#pragma omp for schedule(static)
    for (size_t i = 0; i < n; i += 256) {
      a0 = _mm512_add_epi32(a0, _mm512_load_si512(p + i));
      a1 = _mm512_add_epi32(a1, _mm512_load_si512(p + i + 64));
      a2 = _mm512_add_epi32(a2, _mm512_load_si512(p + i + 128));
      a3 = _mm512_add_epi32(a3, _mm512_load_si512(p + i + 192));
    }
    total += _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)));
  }
  double t = omp_get_wtime() - t0;
  if (total == 42) printf("#");
  return n / t / 1e9;
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static double vnni_gmacs(long steps) {
  double t0 = omp_get_wtime();
  long long total = 0;
#pragma omp parallel reduction(+ : total)
  {
    __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5), a[12];
    for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_epi32(i);
    for (long s = 0; s < steps; ++s) {
      for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbusd_epi32(a[i], w, x);
      __asm__ volatile("" : "+v"(w), "+v"(x));
    }
    __m512i r = a[0];
    for (int i = 1; i < 12; ++i) r = _mm512_add_epi32(r, a[i]);
    total += _mm512_reduce_add_epi32(r);
  }
  double t = omp_get_wtime() - t0;
  if (total == 42) printf("#");
  return double(steps) * 12 * 64 * omp_get_max_threads() / t / 1e9;
}

int main(int argc, char** argv) {  // argv: "vnni" or "-", MiB to read, vpdpbusd steps
  size_t n = size_t(atol(argv[2])) << 20;
  for (int huge = 0; huge < 2; ++huge) {
    char* p = static_cast<char*>(aligned_alloc(size_t(2) << 20, n));
    if (huge) madvise(p, n, MADV_HUGEPAGE);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i += 4096) memset(p + i, 1, 4096);
    read_gbs(p, n);
    printf("%s %.2f\n", huge ? "read2m" : "read", read_gbs(p, n));
    free(p);
  }
  if (strcmp(argv[1], "vnni") == 0) printf("vpdpbusd %.2f\n", vnni_gmacs(atol(argv[3])));
  return 0;
}
"""


# The phase probe: one thread pinned to each CPU, all at once: a chain of dependent multiply-adds (no memory: how fast
# that vCPU runs now) and then a read of its own buffer in 2 MiB pages (its share of the memory's rate now). On a
# shared VM a vCPU whose host core is busy, or a CPU another process holds, shows as a longer spin on that CPU alone.
_PHASE_SOURCE = r"""
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
struct Job { int cpu; long spins; size_t bytes; char* buf; double spin_ms, read_gbs; pthread_barrier_t* bar; };

__attribute__((target("avx512f"))) static long long read_all(const char* p, size_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < n; i += 256) {
    a0 = _mm512_add_epi32(a0, _mm512_load_si512(p + i));
    a1 = _mm512_add_epi32(a1, _mm512_load_si512(p + i + 64));
    a2 = _mm512_add_epi32(a2, _mm512_load_si512(p + i + 128));
    a3 = _mm512_add_epi32(a3, _mm512_load_si512(p + i + 192));
  }
  return _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)));
}

static void* run(void* arg) {
  struct Job* j = (struct Job*)arg;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(j->cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
  memset(j->buf, 1, j->bytes);
  pthread_barrier_wait(j->bar);
  double t0 = now();
  unsigned long x = j->cpu + 1;
  for (long i = 0; i < j->spins; ++i) {
    x = x * 6364136223846793005ul + 1442695040888963407ul;
    __asm__ volatile("" : "+r"(x));
  }
  j->spin_ms = 1e3 * (now() - t0);
  pthread_barrier_wait(j->bar);
  long long s = read_all(j->buf, j->bytes);  // the first pass after the writes; the second one is timed
  t0 = now();
  s += read_all(j->buf, j->bytes);
  j->read_gbs = j->bytes / (now() - t0) / 1e9;
  if (s == 42 && x == 7) printf("#");
  return 0;
}

int main(int argc, char** argv) {  // argv: spin steps, MiB read per CPU, the CPUs (at most 256)
  int n = argc - 3 < 256 ? argc - 3 : 256;
  struct Job jobs[256];
  pthread_t th[256];
  pthread_barrier_t bar;
  pthread_barrier_init(&bar, 0, n);
  size_t bytes = (size_t)atol(argv[2]) << 20;
  for (int i = 0; i < n; ++i) {
    char* p = (char*)aligned_alloc((size_t)2 << 20, bytes);
    madvise(p, bytes, MADV_HUGEPAGE);
    struct Job j = {atoi(argv[3 + i]), atol(argv[1]), bytes, p, 0, 0, &bar};
    jobs[i] = j;
  }
  for (int i = 0; i < n; ++i) pthread_create(&th[i], 0, run, &jobs[i]);
  for (int i = 0; i < n; ++i) pthread_join(th[i], 0);
  for (int i = 0; i < n; ++i) printf("%d %.3f %.2f\n", jobs[i].cpu, jobs[i].spin_ms, jobs[i].read_gbs);
  return 0;
}
"""


class PhaseProbe:
    """Compiled once (``CXX``); each call runs the phase probe: per CPU of this process's affinity (up to 256),
    ``spin_ms`` (a fixed chain of 20M dependent multiply-adds: ~22 ms on this EPYC when the vCPU is whole) and
    ``read_gbs`` (its own 64 MiB, 2 MiB pages, all CPUs reading at once). ~0.1 s. Raises LimitsUnavailable where it
    cannot run (no AVX-512, no compiler, not Linux)."""

    def __init__(self, steps: int = 20_000_000, mib: int = 64):
        flags = _cpu_flags()
        if "avx512f" not in flags or not hasattr(os, "sched_getaffinity"):
            raise LimitsUnavailable("the phase probe needs Linux and AVX-512 F")
        cxx = os.environ.get("CXX", "c++")
        if shutil.which(cxx) is None:
            raise LimitsUnavailable(f"no compiler {cxx!r} (set CXX)")
        self._tmp = tempfile.TemporaryDirectory()
        src, self._exe = Path(self._tmp.name) / "phase.c", Path(self._tmp.name) / "phase"
        src.write_text(_PHASE_SOURCE)
        subprocess.run([cxx, "-x", "c++", "-O2", "-pthread", str(src), "-o", str(self._exe)], check=True)
        self.steps, self.mib = steps, mib

    def __call__(self) -> list[dict[str, float]]:
        """[{"cpu": 0, "spin_ms": ..., "read_gbs": ...}, ...], one per CPU in order."""
        cpus = sorted(os.sched_getaffinity(0))[:256]
        text = subprocess.run([str(self._exe), str(self.steps), str(self.mib), *map(str, cpus)],
                              capture_output=True, text=True, check=True).stdout
        return [{"cpu": int(c), "spin_ms": float(s), "read_gbs": float(r)}
                for c, s, r in (line.split() for line in text.splitlines())]


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


class LimitsUnavailable(RuntimeError):
    """The probes cannot run here (no AVX-512, no compiler); the message says which."""


def measure(threads: list[int], repeats: int, mib: int = 512, steps: int = 20_000_000
            ) -> dict[int, dict[str, list[float]]]:
    """threads -> {"read": GB/s (4 KiB pages), "read2m": GB/s (2 MiB pages), "vpdpbusd": GMAC/s} per repeat (an empty
    vpdpbusd list without VNNI), reading ``mib`` MiB and running ``steps`` vpdpbusd steps. Raises LimitsUnavailable
    where the probes cannot run."""
    flags = _cpu_flags()
    if "avx512f" not in flags or "avx512bw" not in flags:
        raise LimitsUnavailable("the probes need AVX-512 (F, BW); this CPU lacks them")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise LimitsUnavailable(f"no compiler {cxx!r} (set CXX)")
    vnni = "avx512_vnni" in flags
    out: dict[int, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "limits.cpp", Path(tmp) / "limits"
        src.write_text(_SOURCE)
        subprocess.run([cxx, "-O2", "-fopenmp", str(src), "-o", str(exe)], check=True)
        for t in threads:
            got: dict[str, list[float]] = {"read": [], "read2m": [], "vpdpbusd": []}
            for _ in range(repeats):
                cmd = [str(exe), "vnni" if vnni else "-", str(mib), str(steps)]
                text = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                      env={**os.environ, "OMP_NUM_THREADS": str(t)}).stdout
                for line in text.splitlines():
                    name, value = line.split()
                    got[name].append(float(value))
            out[t] = got
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--smoke", action="store_true", help="1 thread, 1 short run (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.threads, args.repeats = [1], 1
    header = ("| threads | read GB/s, 4 KiB pages (median, min-max) | read GB/s, 2 MiB pages | vpdpbusd GMAC/s |\n"
              "|---|---|---|---|")
    try:
        got = measure(args.threads, args.repeats, *((32, 1_000_000) if args.smoke else ()))
    except LimitsUnavailable as e:
        if not args.smoke:
            sys.exit(f"machine_limits: {e}")
        print(f"{header}\n| - | n/a ({e}) | n/a | n/a |")  # the smoke run checks the script, not the CPU
        return
    print(header)
    for t, values in got.items():
        cells = [f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" if v else "n/a (no VNNI)"
                 for v in values.values()]
        print(f"| {t} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
