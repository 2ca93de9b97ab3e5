"""What this machine's cores can do at most, for reading the figures of ``bench/gguf_formats.py`` against.

    python bench/machine_limits.py [--repeats 5] [--threads 1 2] [--smoke]

Two probes, compiled here with the native build's compiler (``CXX``, default ``c++``) into a temporary directory and
run in a subprocess, per thread count t: t threads pinned to the first t CPUs of this process's affinity, started
together at a barrier and timed by the wall clock to the barrier after the last one ends:
- **read**: each thread streams a buffer of its own (first touched by itself; 512 MiB in all) with vector loads into
  four independent sums (no arithmetic to hide), 10 passes alternating one stream and two (its halves side by side),
  the fastest pass kept: the machine's best read rate, the ceiling of one-row decode, which reads every weight once
  per token; in the kernel's 4 KiB pages, and in 2 MiB pages (``madvise(MADV_HUGEPAGE)``, as ``LLM`` holds a model's
  weights: ``dtorch.core.memory.huge_pages``), where a stream pays no page walk every 4 KiB (on the AVX-512 EPYC VM
  one core read ~1.6x as fast). The loads are 64 bytes (AVX-512), 32 (AVX2) or 16 (SSE2): the widest this CPU has
  and ``DTORCH_CPU_FEATURES`` does not force off (``-avx512``, ``-avx2``);
- **vpdpbusd**: 12 independent 512-bit accumulators per thread, each step one ``vpdpbusd`` (64 int8 multiply-adds):
  the ceiling of any integer-dot-product kernel for prompts and batched decode on AVX-512 VNNI (needs the
  ``avx512_vnni`` CPU flag; skipped without it).

The probe measured the read at 2 threads as one OpenMP team over one shared buffer, threads unpinned, one pass: 31.9
GB/s, no more than one thread's, while the phase probe's pinned threads read ~31 GB/s each at once and the one-row
products at 2 threads 40-52: each pass now is the slowest pinned thread's, and the best of 10 is kept.

How to read them: a decode token reads the model's weight bytes once (for the 0.6B Q4_K_M file, ~395 MB), so
tok/s <= read GB/s / weight GB (``gguf_formats.py``'s roofline table); a prompt of T tokens multiplies about T x (the
layers' weights) int8 pairs, so tok/s <= vpdpbusd GMAC/s / (GMAC per token). The issue's targets are ratios to
llama.cpp on the same machine: where the ratio times llama.cpp's own rate passes these ceilings, no kernel on this
CPU reaches it.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# The read loop both probes share: four independent sums of vector loads (no arithmetic to hide), in 64-byte vectors
# (AVX-512), 32-byte (AVX2) or 16-byte (SSE2, every x86-64): the same loop, instantiated per ISA. ``read_bytes`` reads
# [p, p + n) in ``streams`` interleaved parts (1: front to back; 2: its halves side by side, two streams for the
# hardware prefetcher to follow).
_READ_SOURCE = r"""
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

template <class V>
__attribute__((always_inline)) static inline long long read_loop(const char* p, size_t n, int streams) {
  V a0 = {}, a1 = {}, a2 = {}, a3 = {};
  const size_t w = sizeof(V), part = n / streams;
  if (streams == 1) {
    for (size_t i = 0; i < n; i += 4 * w) {
      a0 += *(const V*)(p + i); a1 += *(const V*)(p + i + w);
      a2 += *(const V*)(p + i + 2 * w); a3 += *(const V*)(p + i + 3 * w);
    }
  } else {
    for (size_t i = 0; i < part; i += 2 * w) {
      a0 += *(const V*)(p + i); a1 += *(const V*)(p + i + w);
      a2 += *(const V*)(p + part + i); a3 += *(const V*)(p + part + i + w);
    }
  }
  V s = a0 + a1 + a2 + a3;
  long long t = 0;
  for (size_t k = 0; k < w / sizeof(int); ++k) t += s[k];
  return t;
}
typedef int v16i __attribute__((vector_size(64)));
typedef int v8i __attribute__((vector_size(32)));
typedef int v4i __attribute__((vector_size(16)));
__attribute__((target("avx512f"))) static long long read512(const char* p, size_t n, int s) {
  return read_loop<v16i>(p, n, s);
}
__attribute__((target("avx2"))) static long long read256(const char* p, size_t n, int s) {
  return read_loop<v8i>(p, n, s);
}
static long long read128(const char* p, size_t n, int s) { return read_loop<v4i>(p, n, s); }
static int g_isa = 128;  // 512, 256 or 128: the vector width the probe reads with
static long long read_bytes(const char* p, size_t n, int streams) {
  return g_isa == 512 ? read512(p, n, streams) : g_isa == 256 ? read256(p, n, streams) : read128(p, n, streams);
}
static void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}
static char* buffer(size_t bytes, int huge) {  // 2 MiB aligned, in 2 MiB pages (huge) or 4 KiB ones, untouched
  char* p = (char*)aligned_alloc((size_t)2 << 20, bytes);
  madvise(p, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  return p;
}
"""

# The limits probe: per thread count t, t threads pinned to the first t CPUs, each reading a buffer of its own
# (first touched by itself) of MiB / t, all at once between two barriers; each pass timed by the wall clock from
# the first barrier to the second, passes alternating one and two streams a thread; the fastest pass of each page
# size is the machine's best read at t threads. Then the vpdpbusd spin on the same threads.
_SOURCE = _READ_SOURCE + r"""
struct Job {
  int id, cpu, huge, passes;
  size_t bytes;
  long steps;
  double* secs;
  pthread_barrier_t* bar;
  long long sink;
};

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static long long vnni_spin(long steps) {
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5), a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_epi32(i);
  for (long s = 0; s < steps; ++s) {
    for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbusd_epi32(a[i], w, x);
    __asm__ volatile("" : "+v"(w), "+v"(x));
  }
  __m512i r = a[0];
  for (int i = 1; i < 12; ++i) r = _mm512_add_epi32(r, a[i]);
  return _mm512_reduce_add_epi32(r);
}

static void* run(void* arg) {
  struct Job* j = (struct Job*)arg;
  pin(j->cpu);
  if (j->steps) {  // the vpdpbusd spin: one untimed, one timed
    j->sink += vnni_spin(j->steps / 10);
    pthread_barrier_wait(j->bar);
    double t0 = now();
    j->sink += vnni_spin(j->steps);
    pthread_barrier_wait(j->bar);
    if (j->id == 0) j->secs[0] = now() - t0;
    return 0;
  }
  char* p = buffer(j->bytes, j->huge);
  memset(p, 1, j->bytes);
  j->sink += read_bytes(p, j->bytes, 1);
  for (int i = 0; i < j->passes; ++i) {
    pthread_barrier_wait(j->bar);
    double t0 = now();
    j->sink += read_bytes(p, j->bytes, 1 + i % 2);
    pthread_barrier_wait(j->bar);
    if (j->id == 0) j->secs[i] = now() - t0;
  }
  free(p);
  return 0;
}

// one team of t threads on cpus[0..t): each its share of `bytes` (or `steps` vpdpbusd steps); secs[i] per pass
static long long team(int t, const int* cpus, int huge, int passes, size_t bytes, long steps, double* secs) {
  struct Job jobs[256];
  pthread_t th[256];
  pthread_barrier_t bar;
  pthread_barrier_init(&bar, 0, t);
  for (int i = 0; i < t; ++i) {
    struct Job j = {i, cpus[i], huge, passes, bytes / t / 4096 * 4096, steps, secs, &bar, 0};
    jobs[i] = j;
  }
  for (int i = 0; i < t; ++i) pthread_create(&th[i], 0, run, &jobs[i]);
  long long sink = 0;
  for (int i = 0; i < t; ++i) { pthread_join(th[i], 0); sink += jobs[i].sink; }
  pthread_barrier_destroy(&bar);
  return sink;
}

int main(int argc, char** argv) {  // argv: vector bits (512/256/128), "vnni" or "-", MiB, passes, steps, CPUs
  g_isa = atoi(argv[1]);
  size_t bytes = (size_t)atol(argv[3]) << 20;
  int passes = atoi(argv[4]), t = argc - 6 < 256 ? argc - 6 : 256, cpus[256];
  for (int i = 0; i < t; ++i) cpus[i] = atoi(argv[6 + i]);
  double secs[256];
  long long sink = 0;
  for (int huge = 0; huge < 2; ++huge) {
    sink += team(t, cpus, huge, passes, bytes, 0, secs);
    printf("%s", huge ? "read2m" : "read");
    size_t per = bytes / t / 4096 * 4096 * t;
    for (int i = 0; i < passes; ++i) printf(" %d:%.2f", 1 + i % 2, per / secs[i] / 1e9);
    printf("\n");
  }
  if (strcmp(argv[2], "vnni") == 0) {
    long steps = atol(argv[5]);
    sink += team(t, cpus, 0, 1, 0, steps, secs);
    printf("vpdpbusd 0:%.2f\n", (double)steps * 12 * 64 * t / secs[0] / 1e9);
  }
  if (sink == 42) printf("#\n");
  return 0;
}
"""


# The phase probe: one thread pinned to each CPU, all at once: a chain of dependent multiply-adds (no memory: how fast
# that vCPU runs now) and then a read of its own buffer in 2 MiB pages (its share of the memory's rate now). On a
# shared VM a vCPU whose host core is busy, or a CPU another process holds, shows as a longer spin on that CPU alone.
_PHASE_SOURCE = _READ_SOURCE + r"""
struct Job { int cpu; long spins; size_t bytes; char* buf; double spin_ms, read_gbs; pthread_barrier_t* bar; };

static void* run(void* arg) {
  struct Job* j = (struct Job*)arg;
  pin(j->cpu);
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
  long long s = read_bytes(j->buf, j->bytes, 1);  // the first pass after the writes; the second one is timed
  t0 = now();
  s += read_bytes(j->buf, j->bytes, 1);
  j->read_gbs = j->bytes / (now() - t0) / 1e9;
  if (s == 42 && x == 7) printf("#");
  return 0;
}

int main(int argc, char** argv) {  // argv: vector bits (512/256/128), spin steps, MiB read per CPU, the CPUs (<= 256)
  g_isa = atoi(argv[1]);
  int n = argc - 4 < 256 ? argc - 4 : 256;
  struct Job jobs[256];
  pthread_t th[256];
  pthread_barrier_t bar;
  pthread_barrier_init(&bar, 0, n);
  size_t bytes = (size_t)atol(argv[3]) << 20;
  for (int i = 0; i < n; ++i) {
    struct Job j = {atoi(argv[4 + i]), atol(argv[2]), bytes, buffer(bytes, 1), 0, 0, &bar};
    jobs[i] = j;
  }
  for (int i = 0; i < n; ++i) pthread_create(&th[i], 0, run, &jobs[i]);
  for (int i = 0; i < n; ++i) pthread_join(th[i], 0);
  for (int i = 0; i < n; ++i) printf("%d %.3f %.2f\n", jobs[i].cpu, jobs[i].spin_ms, jobs[i].read_gbs);
  return 0;
}
"""


class LimitsUnavailable(RuntimeError):
    """The probes cannot run here (not x86-64 Linux, no compiler); the message says which."""


def vector_bits() -> int:
    """The widest vector the probes read with here: 512 (AVX-512 F), 256 (AVX2) or 128 (SSE2, every x86-64), each
    wider one skipped where the CPU lacks it or ``DTORCH_CPU_FEATURES`` forces it off (``-avx512``, ``-avx2``)."""
    from dtorch.core import cpu

    if cpu.really_has("avx512") and not cpu.ruled_out("avx512"):
        return 512
    return 256 if cpu.really_has("avx2") and not cpu.ruled_out("avx2") else 128


def _vnni() -> bool:
    from dtorch.core import cpu

    return cpu.really_has("avx512_vnni") and not cpu.ruled_out("avx512_vnni") and not cpu.ruled_out("avx512")


def _compile(source: str, folder: str, name: str) -> Path:
    """``source`` built with ``CXX`` (default c++) into ``folder``/``name``; LimitsUnavailable where it cannot be."""
    if platform.machine() not in ("x86_64", "AMD64") or not hasattr(os, "sched_getaffinity"):
        raise LimitsUnavailable(f"the probes need x86-64 Linux, not {platform.machine()} {sys.platform}")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise LimitsUnavailable(f"no compiler {cxx!r} (set CXX)")
    src, exe = Path(folder) / f"{name}.cpp", Path(folder) / name
    src.write_text(source)
    subprocess.run([cxx, "-O2", "-pthread", "-Wno-psabi", str(src), "-o", str(exe)], check=True)
    return exe


class PhaseProbe:
    """Compiled once (``CXX``); each call runs the phase probe: per CPU of this process's affinity (up to 256),
    ``spin_ms`` (a fixed chain of 20M dependent multiply-adds: ~22 ms on this EPYC when the vCPU is whole) and
    ``read_gbs`` (its own 64 MiB, 2 MiB pages, all CPUs reading at once). ~0.1 s. Raises LimitsUnavailable where it
    cannot run (not x86-64 Linux, no compiler)."""

    def __init__(self, steps: int = 20_000_000, mib: int = 64):
        self._tmp = tempfile.TemporaryDirectory()
        self._exe = _compile(_PHASE_SOURCE, self._tmp.name, "phase")
        self.steps, self.mib, self.bits = steps, mib, vector_bits()

    def __call__(self) -> list[dict[str, float]]:
        """[{"cpu": 0, "spin_ms": ..., "read_gbs": ...}, ...], one per CPU in order."""
        cpus = sorted(os.sched_getaffinity(0))[:256]
        text = subprocess.run([str(self._exe), str(self.bits), str(self.steps), str(self.mib), *map(str, cpus)],
                              capture_output=True, text=True, check=True).stdout
        return [{"cpu": int(c), "spin_ms": float(s), "read_gbs": float(r)}
                for c, s, r in (line.split() for line in text.splitlines())]


def measure(threads: list[int], repeats: int, mib: int = 512, steps: int = 20_000_000, passes: int = 10
            ) -> dict[int, dict[str, list[float]]]:
    """threads -> {"read": GB/s (4 KiB pages), "read2m": GB/s (2 MiB pages), "vpdpbusd": GMAC/s}, one value per
    repeat: that run's fastest of ``passes`` passes (an empty vpdpbusd list without VNNI). Each run pins its t threads
    to the first t CPUs of this process's affinity, each reading ``mib`` / t MiB of its own at once, passes
    alternating one and two streams a thread. Raises LimitsUnavailable where the probes cannot run (or t exceeds the
    CPUs)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if cpus and max(threads) > len(cpus):
        raise LimitsUnavailable(f"{max(threads)} threads asked, {len(cpus)} CPUs in this process's affinity")
    bits, vnni = vector_bits(), _vnni()
    out: dict[int, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        exe = _compile(_SOURCE, tmp, "limits")
        for t in threads:
            got: dict[str, list[float]] = {"read": [], "read2m": [], "vpdpbusd": []}
            for _ in range(repeats):
                cmd = [str(exe), str(bits), "vnni" if vnni else "-", str(mib), str(passes), str(steps),
                       *map(str, cpus[:t])]
                for line in subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines():
                    name, *values = line.split()
                    got[name].append(max(float(v.split(":")[1]) for v in values))
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
    header = ("| threads | read GB/s, 4 KiB pages (best pass: median of runs, min-max) | read GB/s, 2 MiB pages | "
              "vpdpbusd GMAC/s |\n|---|---|---|---|")
    try:
        got = measure(args.threads, args.repeats, *((32, 1_000_000, 2) if args.smoke else ()))
    except LimitsUnavailable as e:
        if not args.smoke:
            sys.exit(f"machine_limits: {e}")
        print(f"{header}\n| - | n/a ({e}) | n/a | n/a |")  # the smoke run checks the script, not the CPU
        return
    print(f"{vector_bits()}-bit loads\n")
    print(header)
    for t, values in got.items():
        cells = [f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" if v else "n/a (no VNNI)"
                 for v in values.values()]
        print(f"| {t} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
