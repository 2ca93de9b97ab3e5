// The Python module _dtorch_native: argument checks, workspace, threads (torch's intra-op pool through
// at::parallel_for, split over output rows) and the ISA choice; the kernels live in the isa_*.cpp units. The
// functions of the declared rows (DTN_OP, ops/<group>.def) are made at import from the rows' descriptions, which
// table.cpp holds (py_row and RowCall, below): this unit reads no row, so a new row does not recompile it. The others
// (DTN_ENTRY rows of entries.def) are written here.
// Functions take torch tensors (METH_FASTCALL, no copies) and raise the dtorch errors registered by set_errors.
#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/_softmax.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/sum.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <new>
#include <vector>

#include "common.h"
#include "table.h"

namespace {

const dtn::Table* g_table = nullptr;
// dtorch error classes, set from Python (ShapeError, DTypeError, LayoutError, ArgumentError)
PyObject* g_shape_error = PyExc_ValueError;
PyObject* g_dtype_error = PyExc_TypeError;
PyObject* g_layout_error = PyExc_ValueError;
PyObject* g_arg_error = PyExc_ValueError;

struct Fail {};  // a Python error is set; unwind to the entry point

[[noreturn]] void fail(PyObject* type, const std::string& msg) {
  PyErr_SetString(type, msg.c_str());
  throw Fail{};
}

std::string dims(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

const char* dtype_name(const at::Tensor& t) { return c10::toString(t.scalar_type()); }

bool cpu_has(const char* f) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (!std::string(f).compare("avx512")) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }
  if (!std::string(f).compare("avx2"))
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
  return !std::string(f).compare("portable");
}

// the kernel table of an ISA (table.cpp), or nullptr when this build has none (an x86 ISA elsewhere)
const dtn::Table* table_for(const std::string& isa) { return dtn::table(isa.c_str(), nullptr); }

const at::Tensor& tensor(PyObject* o, const char* op, const char* name) {
  if (!THPVariable_Check(o)) fail(g_arg_error, std::string(op) + ": " + name + " must be a torch.Tensor, got " +
                                               Py_TYPE(o)->tp_name);
  const at::Tensor& t = THPVariable_Unpack(o);
  if (!t.device().is_cpu()) fail(g_arg_error, std::string(op) + ": " + name + " must be on the cpu");
  if (!t.is_contiguous())
    fail(g_layout_error, std::string(op) + ": " + name + " " + dims(t) + " must be contiguous (call .contiguous())");
  return t;
}

// a cpu tensor that may be strided (checked by row_stride)
const at::Tensor& any_tensor(PyObject* o, const char* op, const char* name) {
  if (!THPVariable_Check(o)) fail(g_arg_error, std::string(op) + ": " + name + " must be a torch.Tensor, got " +
                                               Py_TYPE(o)->tp_name);
  const at::Tensor& t = THPVariable_Unpack(o);
  if (!t.device().is_cpu()) fail(g_arg_error, std::string(op) + ": " + name + " must be on the cpu");
  return t;
}

// t [..., inner dims]: the last `inner` dims dense, the leading dims one uniform row stride (views such as the
// q/k heads of a fused qkv output); returns that row stride in elements
int64_t row_stride(const at::Tensor& t, int inner, const char* op, const char* name) {
  int64_t dense = 1;
  for (int64_t d = t.dim() - 1; d >= t.dim() - inner && d >= 0; --d) {
    if (t.size(d) != 1 && t.stride(d) != dense)
      fail(g_layout_error, std::string(op) + ": " + name + " " + dims(t) + " must be dense in its last " +
           std::to_string(inner) + " dim(s)");
    dense *= t.size(d);
  }
  int64_t rs = dense, next = -1;
  for (int64_t d = t.dim() - inner - 1; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (next < 0) {
      rs = t.stride(d);
    } else if (t.stride(d) != next) {
      fail(g_layout_error, std::string(op) + ": " + name + " " + dims(t) + " rows must have one stride");
    }
    next = t.stride(d) * t.size(d);
  }
  return rs;
}

int float_dt(const at::Tensor& t, const char* op, const char* name) {
  if (t.scalar_type() == at::kFloat) return dtn::F32;
  if (t.scalar_type() == at::kBFloat16) return dtn::BF16;
  fail(g_dtype_error, std::string(op) + ": " + name + " must be float32 or bfloat16, got " + dtype_name(t));
}

// a check that builds its message only when it fails: these run on every call of a decode step, where building
// each message (shapes formatted, strings joined) cost qlinear ~2 us a call
#define NEED(ok, type, msg) \
  do {                      \
    if (!(ok)) fail(type, msg); \
  } while (0)
#define need(ok, type, msg) NEED(ok, type, msg)

void need_dtype(const at::Tensor& t, at::ScalarType st, const char* op, const char* name) {
  if (t.scalar_type() != st)
    fail(g_dtype_error, std::string(op) + ": " + name + " must be " + c10::toString(st) + ", got " + dtype_name(t));
}

void need_args(Py_ssize_t n, Py_ssize_t want, const char* op) {
  if (n != want) fail(g_arg_error, std::string(op) + ": expected " + std::to_string(want) + " arguments, got " +
                                       std::to_string(n));
}

// Runs fn with the GIL released. An exception fn throws (an ATen error from a float panel) must not unwind past the
// release: it is caught there and raised as RuntimeError("<op>: <its message>") once the GIL is held again.
template <class F>
void without_gil(const char* op, F&& fn) {
  std::string err;
  Py_BEGIN_ALLOW_THREADS
  try {
    fn();
  } catch (const std::exception& e) {
    err = e.what();
  }
  Py_END_ALLOW_THREADS
  need(err.empty(), PyExc_RuntimeError, std::string(op) + ": " + err);
}

template <class F>
void parallel_rows(int64_t n, int64_t work_per_row, F&& f) {  // chunks of at least ~32k multiply-adds
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, work_per_row));
  if (n <= grain) return f(0, n);
  at::parallel_for(0, n, grain, f);
}

// How a product's output rows are shared among the intra-op threads (set_row_split). "static" (the default):
// at::parallel_for's even split, one contiguous range a thread. "claimed": each thread claims its next chunk from a
// shared counter, so a thread that runs slower (a vCPU whose host core is busy, a neighbour's process on its CPU)
// takes fewer rows, where the even split makes the others wait for its half at every product's end; but each chunk
// restarts the decode kernels' streams and prefetches (kq_split512's four streams, the software stream's first
// bytes), which cost more than the balance gained on a quiet machine (Qwen2.5-1.5B Q4_K_M, 2 threads: see
// bench/real_shapes.md)
bool g_claimed_rows = false;
// rows each OpenMP thread has computed through parallel_rows_claimed since the last row_counts(reset): how the
// threads' real speeds compared (equal speeds claim equal rows)
constexpr int kCountedThreads = 8;
std::atomic<int64_t> g_rows_by_thread[kCountedThreads];

// parallel_rows over a product's N output rows, chunks claimed largest first: a claim takes 1 / (2 threads) of the
// rows left, whole 16-row groups (the 32-block decodes' chunk), at least ~64 KB of multiply-adds: two equal
// threads' first chunks are a quarter of N each (long streams for the hardware prefetcher: kq_split512 reads a chunk
// as four), the small ones at the end even out the finish (~20 claims for N = 8960). Each row's result is the same
// bits under any split (rows are independent; tests: rows_together, claimed_row_split).
template <class F>
void parallel_rows_claimed(int64_t n, int64_t work_per_row, F&& f) {
  const int threads = at::get_num_threads();
  if (!g_claimed_rows || threads < 2 || at::in_parallel_region()) return parallel_rows(n, work_per_row, f);
  const int64_t least = std::max<int64_t>(16, ((int64_t(1) << 16) / std::max<int64_t>(1, work_per_row) + 15) / 16 * 16);
  if (n <= least) return f(0, n);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    const int tid = at::get_thread_num();
    int64_t done = 0;
    for (int64_t start = next.load(std::memory_order_relaxed), size;;) {
      do {
        if (start >= n) {
          if (tid < kCountedThreads) g_rows_by_thread[tid].fetch_add(done, std::memory_order_relaxed);
          return;
        }
        size = std::max(least, ((n - start) / (2 * threads) + 15) / 16 * 16);
      } while (!next.compare_exchange_weak(start, start + size, std::memory_order_relaxed));
      const int64_t end = std::min(n, start + size);
      f(start, end);
      done += end - start;
      start = next.load(std::memory_order_relaxed);
    }
  });
}

// Storage on 64-byte lines: the decode kernels load a super-group's activation levels (1 KB) and its block scales 64
// bytes at a time, and a load across two lines costs a Zen 4 core two (malloc's 16-byte alignment put them across:
// hot Q6_K one-row products 5% slower)
template <class T>
struct LineAlloc {
  using value_type = T;
  LineAlloc() = default;
  template <class U>
  LineAlloc(const LineAlloc<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const LineAlloc<U>&) const { return true; }
};
template <class T>
using LineVec = std::vector<T, LineAlloc<T>>;

// per-thread activation workspace (QAct / SGAct arrays); grows, never shrinks
struct Workspace {
  LineVec<int8_t> q;
  LineVec<float> darep, asum, halves;
};
thread_local Workspace t_ws;

// bytes of the qs and d sections of a packed row (dtorch/kernels/layouts.py), and the block size, per format
struct Sizes { int64_t qs, d, aux, block; };
Sizes sizes(int fmt, int64_t K) {
  switch (fmt) {
    case dtn::Q8_0: return {K, K / 16, 0, 32};
    case dtn::Q4_0: return {K / 2, K / 16, 0, 32};
    case dtn::Q4_1: return {K / 2, K / 8, 0, 32};
    case dtn::Q4_K: return {K / 256 * 148, 0, 0, 256};
    case dtn::Q6_K: return {K / 256 * 210, 0, 0, 256};
    case dtn::Q5_0: return {K / 32 * 20, K / 16, 0, 32};
    case dtn::Q5_1: return {K / 32 * 20, K / 8, 0, 32};
    case dtn::IQ4_NL: return {K / 2, K / 16, 0, 32};
    case dtn::Q2_K: return {K / 4, K / 64, K / 16, 256};
    case dtn::Q3_K: return {K / 256 * 96, K / 128, K / 16, 256};
    case dtn::Q5_K: return {K / 256 * 180, 0, 0, 256};
    case dtn::IQ4_XS: return {K / 256 * 138, 0, 0, 256};
  }
  fail(g_arg_error, "qlinear: unknown format code " + std::to_string(fmt));
}

// Element k of the K inputs that position i of a dequantized row holds (Table::dequant): the packed order
std::vector<int64_t> kernel_order(int fmt, int64_t K) {
  std::vector<int64_t> k(size_t(K), 0);
  // super-block b: [v 0..7][sub-block j][4] holds element 256 b + 32 j + 4 v + t
  if (fmt == dtn::Q4_K || fmt == dtn::Q5_K || fmt == dtn::Q6_K || fmt == dtn::IQ4_XS) {
    for (int64_t i = 0; i < K; ++i) k[size_t(i)] = i / 256 * 256 + (i % 32) / 4 * 32 + (i % 256) / 32 * 4 + i % 4;
  } else if (dtn::super_grouped(fmt)) {  // super-group g of S blocks: [v 0..7][block j][4] holds element 32 (16 g + j) + 4 v + t
    for (int64_t g = 0, nb = K / 32; g * 16 < nb; ++g) {
      const int64_t S = std::min<int64_t>(16, nb - g * 16);
      for (int64_t v = 0; v < 8; ++v)
        for (int64_t j = 0; j < S; ++j)
          for (int64_t t = 0; t < 4; ++t) k[size_t(g * 512 + v * 4 * S + 4 * j + t)] = (16 * g + j) * 32 + 4 * v + t;
    }
  } else {  // group g of gs sub-blocks at 128 g: half h, position i holds element 128 g + 32 (i / 16) + 16 h + i % 16
    for (int64_t g = 0, nb = K / 32; g * 4 < nb; ++g) {
      const int64_t gs = std::min<int64_t>(4, nb - g * 4);
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t i = 0; i < 16 * gs; ++i) k[size_t(g * 128 + h * 16 * gs + i)] = g * 128 + 32 * (i / 16) + 16 * h + i % 16;
    }
  }
  return k;
}

// From this many rows of x on, qlinear dequantizes panels of the weight to float32 and multiplies them in a float
// GEMM (exact float products; the integer kernels' work grows with the rows, the dequantization does not): the
// dequantization costs as much as ~20-40 rows of integer products (a [576, 49152] head crosses at ~38 rows, a
// [576, 960] projection at ~20), so decode batches up to 32 rows stay integer. With AVX-512 VNNI (Table::int_prefill)
// the integer tiles run 45-110 GMAC/s on one core, by format, and the float panels only pay from kOneDnnRows rows
// in oneDNN's GEMM (float_rows).
constexpr int64_t kFloatRows = 32;
// oneDNN's float32 GEMM (torch's mkldnn::_linear_pointwise) reaches ~107 GMAC/s on one AVX-512 core where torch's
// mm (MKL on an AMD CPU) runs ~40; with the panels' dequantization, measured on one core of an AVX-512 VNNI EPYC:
// 53-77 GMAC/s at 64 rows, 75-91 at 128, 98-107 at 512, against the two-level integer tiles' 45-56 (K = 576: Q5_0,
// Q5_1, Q6_K, IQ4_NL), 54-68 (Q6_K at K = 1024, 3072) and 93-109 (Q4_K, Q5_K, IQ4_XS at K = 1024). oneDNN shares
// each product among the intra-op threads, which pays on larger products only: the panels take kOneDnnRows rows per
// thread (measured on one and two). Q8_0's tiles (two steps a pass, the tails in their own pass) keep up with the
// panels in the model, where the panels' dequantization reads cold weights: prompts of 128 / 512 / 1000 tokens of a
// Qwen3-0.6B-shaped Q8_0 file 1.29x / 1.01x / 1.01x the panels' speed on one thread, 1.02-1.06x on two (SmolLM2 Q8_0:
// 0.98-1.36x)
constexpr int64_t kOneDnnRows = 128;
// which float GEMM the panels go through: oneDNN's when torch has it, or torch's mm (set_float_gemm)
bool g_onednn = true;
// Coarse rows (one_level) of kFloatRows and more through bfloat16 panels in oneDNN's GEMM, which runs them on AMX
// tiles (set_bf16_panels; the loader sets it where AMX really works, dtorch.core.cpu.use_amx): ~16x a core's VNNI
// int8 rate at 8 bits of mantissa, against the one-level tiles' 8 bits per 32 values
bool g_bf16_panels = false;

// oneDNN's linear op, or null when torch is built without it
const c10::OperatorHandle* onednn_linear() {
  static const std::optional<c10::OperatorHandle> op =
      c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  return g_onednn && op ? &*op : nullptr;
}

// whether rows, coarse or not (one_level), go through the bf16 panels from kFloatRows rows
bool bf16_rows(bool one_level) { return one_level && g_bf16_panels && onednn_linear(); }

// the rows of x from which qlinear takes the float panels for a weight of format fmt, its rows coarse (one_level) or
// not. One level on AVX-512 VNNI: the tiles at every row count, in the model 0.9-2.0x the panels' speed (prompts of
// 128 / 512 tokens, one thread: SmolLM2 Q4_K_M's Q5_0 and Q6_K 1.0-1.6x / 1.7-2.0x; Qwen3-0.6B-shaped Q4_K_M and
// Q6_K files 0.9-1.25x), where the panels' dequantization reads cold weights.
int64_t float_rows(const dtn::Table* tb, int fmt, bool one_level) {
  if (bf16_rows(one_level)) return kFloatRows;
  if (one_level && tb->int_prefill && dtn::super_grouped(fmt)) return INT64_MAX;
  if (!tb->int_prefill || !dtn::super_grouped(fmt)) return kFloatRows;
  const bool fast_tiles = fmt == dtn::Q4_K || fmt == dtn::Q5_K || fmt == dtn::IQ4_XS || fmt == dtn::Q8_0;
  return !fast_tiles && onednn_linear() ? kOneDnnRows * at::get_num_threads() : INT64_MAX;
}

// yv [M, N] (a view) = x [M, K] @ w [N, K].T (+ b [N]), in oneDNN's GEMM or torch's
void panel_product(at::Tensor& yv, const at::Tensor& x, const at::Tensor& w, const at::Tensor* b) {
  if (const c10::OperatorHandle* op = onednn_linear()) {
    torch::jit::Stack st{x, w, b ? c10::IValue(*b) : c10::IValue(), std::string("none"),
                         c10::List<std::optional<at::Scalar>>(), c10::IValue()};
    op->callBoxed(&st);
    yv.copy_(st[0].toTensor());
  } else if (b) {
    at::addmm_out(yv, *b, x, w.t());
  } else {
    at::mm_out(yv, x, w.t());
  }
}

// Coarse rows (the caller's one_level: a prompt's rows, a batch of decodes) of kOneLevelRows rows and more: the
// super-grouped formats (all but Q2_K and Q3_K) round x to one int8 level per block of 32 (SGAct::levels, as
// llama.cpp's Q8_0 activations, finer than its Q8_K's 256): half the integer work, 1.5-2x the two levels' speed at 16
// rows on AVX2, 1.2-2x on 128-512 rows on AVX-512 VNNI. Fewer rows keep both levels (one row waits on memory, not
// on the products: a single sequence's decode keeps its ~16-bit activations for free), and so does every row the
// caller wants as precise as a lone decode's (a speculative step's verified rows).
constexpr int64_t kOneLevelRows = 4;

// M rows of x's super-group activations in this thread's workspace, one or two levels as qlinear's one_level asks
static dtn::SGAct sg_act(int64_t M, int64_t K, int one_level) {
  Workspace& ws = t_ws;
  const int64_t nsg = (K / 32 + 15) / 16;
  if (int64_t(ws.q.size()) < M * nsg * 1024) ws.q.resize(size_t(M * nsg * 1024));
  if (int64_t(ws.darep.size()) < M * nsg * 16) ws.darep.resize(size_t(M * nsg * 16));
  if (int64_t(ws.asum.size()) < M * nsg * 16) ws.asum.resize(size_t(M * nsg * 16));
  if (int64_t(ws.halves.size()) < M * nsg * 32) ws.halves.resize(size_t(M * nsg * 32));
  const int levels = one_level == 2 || (one_level && M >= kOneLevelRows) ? 1 : 2;
  const dtn::SGAct a{ws.q.data(), ws.darep.data(), ws.asum.data(), nsg, ws.halves.data(), levels};
  return a;
}

// y [M, N] = x [M, K] @ dequant(w).T (+ bias) through panels of kPanel bytes of float32 weights: 512 KB on one
// thread (they stay in L2; larger panels measured no faster), more on several, where oneDNN splits each panel's
// product among the threads and small products do not pay for it (two threads, 128-row Q8_0 prompts of a
// Qwen3-0.6B: 0.43x the integer tiles' speed with 512 KB panels, 0.91x with 8 MB; 512 rows: 0.89x, 1.15x)
// bf16: the panels and x rounded to bfloat16 for oneDNN's bf16 GEMM (AMX), the bias added in float32 after it.
void qlinear_float(const dtn::Table* tb, const dtn::QWeight& qw, const at::Tensor& x,
                   const at::Tensor* bias, const at::Tensor& out, int64_t M, int64_t N, int64_t K, bool bf16) {
  const int64_t threads = at::get_num_threads(), kPanel = (512 << 10) * threads * threads;
  const int64_t rows = std::max<int64_t>(16, kPanel / (4 * K) / 16 * 16);
  // x in the packed order and the weight panel live in a per-thread workspace: fresh pages each call cost more
  // than small products
  thread_local std::vector<float> t_xk, t_panel;
  if (int64_t(t_xk.size()) < M * K) t_xk.resize(size_t(M * K));
  if (int64_t(t_panel.size()) < rows * K) t_panel.resize(size_t(rows * K));
  const std::vector<int64_t> order = kernel_order(qw.fmt, K);
  const at::Tensor x2 = x.reshape({M, K}).to(at::kFloat);
  const at::Tensor xk = at::from_blob(t_xk.data(), {M, K}, x2.options().dtype(at::kFloat));
  at::index_select_out(const_cast<at::Tensor&>(xk), x2, 1,
                       at::from_blob(const_cast<int64_t*>(order.data()), {K}, at::kLong));
  const bool direct = out.scalar_type() == at::kFloat;
  const at::Tensor y = direct ? out.view({M, N}) : at::empty({M, N}, xk.options());
  const at::Tensor b32 = bias ? bias->to(at::kFloat) : at::Tensor();
  float* pp = t_panel.data();
  const at::Tensor panel = at::from_blob(pp, {std::min(rows, N), K}, xk.options());
  thread_local std::vector<at::BFloat16> t_xb, t_pb;  // bf16: x and the panel rounded
  if (bf16 && int64_t(t_xb.size()) < M * K) t_xb.resize(size_t(M * K));
  if (bf16 && int64_t(t_pb.size()) < rows * K) t_pb.resize(size_t(rows * K));
  const at::Tensor xb = bf16 ? at::from_blob(t_xb.data(), {M, K}, xk.options().dtype(at::kBFloat16)) : xk;
  const at::Tensor pb = bf16 ? at::from_blob(t_pb.data(), {std::min(rows, N), K}, xb.options()) : panel;
  if (bf16) xb.copy_(xk);
  for (int64_t n0 = 0; n0 < N; n0 += rows) {
    const int64_t nc = std::min(rows, N - n0);
    parallel_rows(nc, 4 * K, [&](int64_t r0, int64_t r1) { tb->dequant(qw, n0 + r0, n0 + r1, pp + r0 * K); });
    at::Tensor yv = y.narrow(1, n0, nc);
    const at::Tensor bv = bias ? b32.narrow(0, n0, nc) : at::Tensor();
    if (bf16) {
      pb.narrow(0, 0, nc).copy_(panel.narrow(0, 0, nc));
      panel_product(yv, xb, pb.narrow(0, 0, nc), nullptr);
      if (bias) yv.add_(bv);
    } else {
      panel_product(yv, xk, panel.narrow(0, 0, nc), bias ? &bv : nullptr);
    }
  }
  if (!direct) out.view({M, N}).copy_(y);
}

// qlinear on the 16-row interleaved layout (common.h's x16_base; base: its row format): 1-3 rows of x in both levels
// through the ISA's own kernel (Table::x16_decode, AVX-512 VNNI), the groups split over the threads; otherwise each
// thread turns its groups back into rows (Table::x16_rows) in a buffer of its own, a few at a time, for the row
// layout's kernels; float panels (many rows): the whole weight turned back once. Every path gives the row layout's
// bits.
void qlinear_x16(const dtn::Table* tb, int base, const at::Tensor& x, const at::Tensor& w, const at::Tensor* bias,
                 const at::Tensor& out, int64_t M, int64_t N, int64_t K, int one_level, int xdt) {
  need(N % 16 == 0 && (K / 32) % 2 == 0, g_shape_error,
       "qlinear: an interleaved (x16) weight needs N a multiple of 16 and K / 32 even; got N = " + std::to_string(N) +
       ", K = " + std::to_string(K) + " (pack it in the row layout instead: layouts.x16_wanted)");
  const Sizes sz = sizes(base, K);
  const int64_t rb = sz.qs + sz.d + sz.aux, G = N / 16;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  auto rows_weight = [&](const uint8_t* p) {
    return dtn::QWeight{base, K, p, rb, reinterpret_cast<const uint16_t*>(p + sz.qs), rb / 2, p + sz.qs + sz.d, rb};
  };
  if (M >= float_rows(tb, base, one_level)) {
    const at::Tensor rows = at::empty({N, rb}, at::kByte);
    uint8_t* rp = rows.data_ptr<uint8_t>();
    without_gil("qlinear", [&] {
      parallel_rows(G, 16 * rb, [&](int64_t g0, int64_t g1) {
        for (int64_t g = g0; g < g1; ++g) tb->x16_rows(base, wp + g * 16 * rb, K, rp + g * 16 * rb, rb);
      });
      qlinear_float(tb, rows_weight(rp), x, bias, out, M, N, K, bf16_rows(one_level));
    });
    return;
  }
  Workspace& ws = t_ws;  // (the caller's: the workers quantize x into it)
  const dtn::SGAct a = sg_act(M, K, one_level);
  const dtn::QWeight qw{int(base == dtn::Q5_0 ? dtn::Q5_0X16 : dtn::Q8_0X16), K, wp, rb, nullptr, 0, nullptr, 0};
  const void* xp = x.data_ptr();
  const char* bp = bias ? static_cast<const char*>(bias->data_ptr()) : nullptr;
  char* yp = static_cast<char*>(out.data_ptr());
  const int64_t es = xdt == dtn::F32 ? 4 : 2;                             // bytes of an element of y and bias
  const int64_t chunk = std::max<int64_t>(1, (int64_t(1) << 18) / (16 * rb));  // groups turned back at a time
  Py_BEGIN_ALLOW_THREADS
  parallel_rows(M, 4 * K, [&](int64_t r0, int64_t r1) {
    tb->quantize_sg(xp, xdt, K, r0, r1, K, ws.q.data(), ws.darep.data(), ws.asum.data(), ws.halves.data(), a.levels);
  });
  parallel_rows(G, 16 * M * K, [&](int64_t g0, int64_t g1) {
    if (tb->x16_decode(qw, a, M, g0, g1, bp, yp, xdt, N)) return;
    thread_local LineVec<uint8_t> buf;
    if (int64_t(buf.size()) < chunk * 16 * rb) buf.resize(size_t(chunk * 16 * rb));
    for (int64_t g = g0; g < g1; g += chunk) {
      const int64_t ge = std::min(g + chunk, g1);
      for (int64_t i = g; i < ge; ++i) tb->x16_rows(base, wp + i * 16 * rb, K, buf.data() + (i - g) * 16 * rb, rb);
      tb->qgemm_sg(rows_weight(buf.data()), a, M, 0, 16 * (ge - g), bp ? bp + 16 * g * es : nullptr,
                   yp + 16 * g * es, xdt, N);
    }
  });
  Py_END_ALLOW_THREADS
}

#define ENTRY(name) PyObject* name(PyObject*, PyObject* const* args, Py_ssize_t nargs) { try {
#define EXIT } catch (const Fail&) { return nullptr; } catch (const std::exception& e) { \
    PyErr_SetString(PyExc_RuntimeError, e.what()); return nullptr; } }

// ===== bound calls (bind): a call parsed and checked once, then run by calling the object with no arguments ======
// What a static plan's bare loop runs each step for the small ops (the declared rows, rope, cache_store): after a
// product streamed its weights through the caches, the argument parse of such a call (the tensors' metadata, the
// checks' code) comes from memory, ~1.5-3 us of a 3-4 us row op on Zen 1. The object keeps the call's arguments
// alive; the pointers it fixed stay valid because a static plan's buffers keep their storage. Each run looks up the
// kernel table in use (set_isa may change it), and reads what a call reads each time (cache_store's slots).
using Run = std::function<void()>;

struct BoundCall {
  PyObject_HEAD
  PyObject* args;  // the bound call's arguments, a tuple
  Run* run;
};

void bound_call_dealloc(PyObject* self) {
  BoundCall* b = reinterpret_cast<BoundCall*>(self);
  Py_XDECREF(b->args);
  delete b->run;
  Py_TYPE(self)->tp_free(self);
}

PyObject* bound_call_call(PyObject* self, PyObject* args, PyObject* kwargs) {
  if ((args && PyTuple_GET_SIZE(args)) || (kwargs && PyDict_GET_SIZE(kwargs))) {
    PyErr_SetString(PyExc_TypeError, "a bound call takes no arguments");
    return nullptr;
  }
  try {
    (*reinterpret_cast<const BoundCall*>(self)->run)();
  } catch (const Fail&) {
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyTypeObject g_bound_call_type = [] {
  PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
  t.tp_name = "_dtorch_native.BoundCall";
  t.tp_basicsize = sizeof(BoundCall);
  t.tp_flags = Py_TPFLAGS_DEFAULT;
  t.tp_doc = "a native call on fixed arguments, parsed once (bind); call it with no arguments";
  t.tp_dealloc = bound_call_dealloc;
  t.tp_call = bound_call_call;
  return t;
}();

// a BoundCall of `run`, holding args[0, nargs)
PyObject* make_bound(Run run, PyObject* const* args, Py_ssize_t nargs) {
  if (PyType_Ready(&g_bound_call_type) < 0) throw Fail{};
  PyObject* kept = PyTuple_New(nargs);
  BoundCall* b = kept ? PyObject_New(BoundCall, &g_bound_call_type) : nullptr;
  if (!b) {
    Py_XDECREF(kept);
    throw Fail{};
  }
  for (Py_ssize_t a = 0; a < nargs; ++a) {
    Py_INCREF(args[a]);
    PyTuple_SET_ITEM(kept, a, args[a]);
  }
  b->args = kept;
  b->run = new Run(std::move(run));
  return reinterpret_cast<PyObject*>(b);
}

// qlinear(x [..., K] f32/bf16, packed uint8 [N, row bytes], fmt int, bias [N] | None, out [..., N])
ENTRY(py_qlinear)
  need(nargs == 5 || nargs == 6, PyExc_TypeError, "qlinear takes 5 or 6 arguments, got " + std::to_string(nargs));
  const at::Tensor& x = tensor(args[0], "qlinear", "x");
  const at::Tensor& w = tensor(args[1], "qlinear", "packed");
  const long fmt = PyLong_AsLong(args[2]);
  if (fmt == -1 && PyErr_Occurred()) throw Fail{};
  const bool has_bias = args[3] != Py_None;
  const at::Tensor* bias = has_bias ? &tensor(args[3], "qlinear", "bias") : nullptr;
  const at::Tensor& out = tensor(args[4], "qlinear", "out");
  // 0: both levels; 1: coarse rows (one level from kOneLevelRows rows); 2: one level at every row count
  const long one_level = nargs == 6 ? PyLong_AsLong(args[5]) : 0;
  if (one_level == -1 && PyErr_Occurred()) throw Fail{};
  need(one_level >= 0 && one_level <= 2, g_arg_error,
       "qlinear: one_level must be 0, 1 (coarse rows) or 2 (every row), got " + std::to_string(one_level));
  const int xdt = float_dt(x, "qlinear", "x");
  need(out.scalar_type() == x.scalar_type(), g_dtype_error,
       std::string("qlinear: out must have x's dtype ") + dtype_name(x) + ", got " + dtype_name(out));
  need_dtype(w, at::kByte, "qlinear", "packed");
  need(x.dim() >= 1 && w.dim() == 2, g_shape_error,
       "qlinear: x must be [..., K] and packed [N, row bytes]; got x " + dims(x) + ", packed " + dims(w));
  const int64_t K = x.size(-1), N = w.size(0), M = K ? x.numel() / K : 0;
  const int x16 = dtn::x16_base(int(fmt));  // the row format of an interleaved layout, else -1
  const Sizes sz = sizes(x16 >= 0 ? x16 : int(fmt), K);
  need(K % sz.block == 0 && K > 0, g_shape_error, "qlinear: K = x.size(-1) = " + std::to_string(K) +
       " must be a positive multiple of the format's block of " + std::to_string(sz.block));
  const int64_t rb = sz.qs + sz.d + sz.aux;
  need(w.size(1) == rb, g_shape_error, "qlinear: packed " + dims(w) + " does not fit K = " + std::to_string(K) +
       ": a row is " + std::to_string(rb) + " bytes (layouts.row_bytes)");
  if (has_bias) {
    need(bias->scalar_type() == x.scalar_type(), g_dtype_error,
         std::string("qlinear: bias must have x's dtype ") + dtype_name(x) + ", got " + dtype_name(*bias));
    need(bias->dim() == 1 && bias->size(0) == N, g_shape_error,
         "qlinear: bias must be [N = " + std::to_string(N) + "], got " + dims(*bias));
  }
  need(out.dim() >= 1 && out.size(-1) == N && out.numel() == M * N, g_shape_error,
       "qlinear: out must be [..., N] with N = " + std::to_string(N) + " and M = " + std::to_string(M) +
       " rows, got " + dims(out));
  const dtn::Table* tb = g_table;
  if (x16 >= 0) {
    qlinear_x16(tb, x16, x, w, bias, out, M, N, K, int(one_level), xdt);
    Py_RETURN_NONE;
  }
  const uint8_t* base = w.data_ptr<uint8_t>();
  const dtn::QWeight qw{int(fmt), K, base, rb, reinterpret_cast<const uint16_t*>(base + sz.qs), rb / 2,
                        base + sz.qs + sz.d, rb};
  const void* bp = has_bias ? bias->data_ptr() : nullptr;
  const void* xp = x.data_ptr();
  void* yp = out.data_ptr();
  if (M >= float_rows(tb, int(fmt), one_level)) {
    without_gil("qlinear", [&] { qlinear_float(tb, qw, x, bias, out, M, N, K, bf16_rows(one_level)); });
    Py_RETURN_NONE;
  }
  Workspace& ws = t_ws;
  if (dtn::super_grouped(int(fmt))) {  // super-groups of 16 blocks (the K-quants: 2 super-blocks of 8)
    const dtn::SGAct a = sg_act(M, K, one_level);
    Py_BEGIN_ALLOW_THREADS
    parallel_rows(M, 4 * K, [&](int64_t r0, int64_t r1) {
      tb->quantize_sg(xp, xdt, K, r0, r1, K, ws.q.data(), ws.darep.data(), ws.asum.data(), ws.halves.data(), a.levels);
    });
    parallel_rows_claimed(N, M * K, [&](int64_t n0, int64_t n1) { tb->qgemm_sg(qw, a, M, n0, n1, bp, yp, xdt, N); });
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
  }
  const int64_t ng = (K / 32 + 3) / 4;
  if (int64_t(ws.q.size()) < M * ng * 256) ws.q.resize(size_t(M * ng * 256));
  if (int64_t(ws.darep.size()) < M * ng * 16) ws.darep.resize(size_t(M * ng * 16));
  if (int64_t(ws.asum.size()) < M * ng * 8) ws.asum.resize(size_t(M * ng * 8));
  const dtn::QAct a{ws.q.data(), ws.darep.data(), ws.asum.data(), ng};
  Py_BEGIN_ALLOW_THREADS
  parallel_rows(M, 4 * K, [&](int64_t r0, int64_t r1) {
    tb->quantize_rows(xp, xdt, K, r0, r1, K, ws.q.data(), ws.darep.data(), ws.asum.data());
  });
  parallel_rows_claimed(N, M * K, [&](int64_t n0, int64_t n1) { tb->qgemm(qw, a, M, n0, n1, bp, yp, xdt, N); });
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
EXIT

// gemv(x [..., K] f32/bf16, w [N, K] f32/bf16/f16, out [..., N] with x's dtype)
ENTRY(py_gemv)
  need_args(nargs, 3, "gemv");
  const at::Tensor& x = tensor(args[0], "gemv", "x");
  const at::Tensor& w = tensor(args[1], "gemv", "w");
  const at::Tensor& out = tensor(args[2], "gemv", "out");
  const int xdt = float_dt(x, "gemv", "x");
  const int wdt = w.scalar_type() == at::kHalf ? int(dtn::F16) : float_dt(w, "gemv", "w");
  need(out.scalar_type() == x.scalar_type(), g_dtype_error,
       std::string("gemv: out must have x's dtype ") + dtype_name(x) + ", got " + dtype_name(out));
  need(x.dim() >= 1 && w.dim() == 2 && x.size(-1) == w.size(1), g_shape_error,
       "gemv: x must be [..., K] and w [N, K]; got x " + dims(x) + ", w " + dims(w));
  const int64_t K = w.size(1), N = w.size(0), M = K ? x.numel() / K : 0;
  need(out.dim() >= 1 && out.size(-1) == N && out.numel() == M * N, g_shape_error,
       "gemv: out must be [..., " + std::to_string(N) + "] with " + std::to_string(M) + " rows, got " + dims(out));
  const dtn::Table* tb = g_table;
  const void *xp = x.data_ptr(), *wp = w.data_ptr();
  void* yp = out.data_ptr();
  Py_BEGIN_ALLOW_THREADS
  parallel_rows_claimed(N, M * K,
                        [&](int64_t n0, int64_t n1) { tb->gemv(xp, xdt, M, wp, wdt, K, n0, n1, yp, xdt, N); });
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
EXIT

// rope(x [..., H, D], cos [..., rot/2] f32, sin like cos, out like x, rot int, interleaved bool); x, out, cos and
// sin may be row-strided views (dense within a row)
// rope's call checked, as what runs it (py_rope runs it at once, bind keeps it)
auto rope_run(PyObject* const* args, Py_ssize_t nargs) {
  need_args(nargs, 6, "rope");
  const at::Tensor& x = any_tensor(args[0], "rope", "x");
  const at::Tensor& c = any_tensor(args[1], "rope", "cos");
  const at::Tensor& s = any_tensor(args[2], "rope", "sin");
  const at::Tensor& out = any_tensor(args[3], "rope", "out");
  const long rot = PyLong_AsLong(args[4]);
  if (rot == -1 && PyErr_Occurred()) throw Fail{};
  const bool interleaved = PyObject_IsTrue(args[5]);
  const int dt = float_dt(x, "rope", "x");
  need_dtype(c, at::kFloat, "rope", "cos");
  need_dtype(s, at::kFloat, "rope", "sin");
  need(out.scalar_type() == x.scalar_type() && out.sizes() == x.sizes(), g_shape_error,
       "rope: out must be like x " + dims(x) + " (" + dtype_name(x) + "), got " + dims(out) + " " + dtype_name(out));
  need(x.dim() >= 2, g_shape_error, "rope: x must be [..., H, D], got " + dims(x));
  const int64_t H = x.size(-2), D = x.size(-1), R = H * D != 0 ? x.numel() / (H * D) : 0;
  need(rot > 0 && rot % 2 == 0 && rot <= D, g_arg_error,
       "rope: rotary_dim must be even and in 2.." + std::to_string(D) + ", got " + std::to_string(rot));
  const int64_t P = c.dim() ? c.numel() / (rot / 2) : 0;
  need(c.dim() >= 1 && c.size(-1) == rot / 2 && s.sizes() == c.sizes() && P > 0 && R % P == 0, g_shape_error,
       "rope: cos and sin must be [..., rotary_dim / 2 = " + std::to_string(rot / 2) + "] with a row count dividing "
       "x's " + std::to_string(R) + " rows; got cos " + dims(c) + ", sin " + dims(s));
  const int64_t ldx = row_stride(x, 2, "rope", "x"), ldo = row_stride(out, 2, "rope", "out");
  const int64_t ldc = row_stride(c, 1, "rope", "cos");
  need(row_stride(s, 1, "rope", "sin") == ldc && s.stride(-1) == 1 && c.stride(-1) == 1, g_layout_error,
       "rope: sin must be laid out like cos");
  const void* xp = x.data_ptr();
  void* op = out.data_ptr();
  const float *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
  return [=] {
    const dtn::Table* tb = g_table;
    Py_BEGIN_ALLOW_THREADS
    parallel_rows(R, 4 * H * rot, [&](int64_t r0, int64_t r1) {
      tb->rope(xp, ldx, op, ldo, dt, cp, sp, ldc, P, r0, r1, H, D, rot, interleaved);
    });
    Py_END_ALLOW_THREADS
  };
}

ENTRY(py_rope)
  rope_run(args, nargs)();
  Py_RETURN_NONE;
EXIT

// set_isa(name): "avx512" | "avx2" | "portable"; the CPU must support it
ENTRY(py_set_isa)
  need_args(nargs, 1, "set_isa");
  const char* s = PyUnicode_AsUTF8(args[0]);
  if (!s) throw Fail{};
  const dtn::Table* t = table_for(s);
  need(t != nullptr, g_arg_error, std::string("native ISA must be one of avx512, avx2, portable; got '") + s + "'");
  need(cpu_has(s), g_arg_error, std::string("this CPU cannot run the ") + s + " kernels (avx512 needs AVX-512 "
       "F/BW/VL/VNNI + FMA + F16C; avx2 needs AVX2 + FMA + F16C)");
  g_table = t;
  Py_RETURN_NONE;
EXIT

// set_bf16_panels(bool | None) -> the setting before: coarse rows through bfloat16 panels (g_bf16_panels)
ENTRY(py_set_bf16_panels)
  need_args(nargs, 1, "set_bf16_panels");
  const bool was = g_bf16_panels;
  if (args[0] != Py_None) {
    const int on = PyObject_IsTrue(args[0]);
    if (on < 0) throw Fail{};
    g_bf16_panels = on;
  }
  return PyBool_FromLong(was);
EXIT

// set_row_split(name | None) -> the name in use before: "claimed" or "static" (g_claimed_rows)
ENTRY(py_set_row_split)
  need_args(nargs, 1, "set_row_split");
  const char* was = g_claimed_rows ? "claimed" : "static";
  if (args[0] != Py_None) {
    const char* s = PyUnicode_AsUTF8(args[0]);
    if (!s) throw Fail{};
    const std::string name(s);
    need(name == "claimed" || name == "static", g_arg_error,
         "row split must be 'claimed' or 'static', got '" + name + "'");
    g_claimed_rows = name == "claimed";
  }
  return PyUnicode_FromString(was);
EXIT

// row_counts(reset: bool) -> [rows computed by OpenMP thread 0, 1, ...] through claimed splits since the last reset
ENTRY(py_row_counts)
  need_args(nargs, 1, "row_counts");
  const int reset = PyObject_IsTrue(args[0]);
  if (reset < 0) throw Fail{};
  PyObject* out = PyList_New(kCountedThreads);
  if (!out) throw Fail{};
  for (int i = 0; i < kCountedThreads; ++i) {
    const int64_t v = reset ? g_rows_by_thread[i].exchange(0) : g_rows_by_thread[i].load();
    PyList_SET_ITEM(out, i, PyLong_FromLongLong(v));
  }
  return out;
EXIT

// set_float_gemm(name | None) -> the name in use before: "onednn" or "torch" (torch has no oneDNN: always "torch")
ENTRY(py_set_float_gemm)
  need_args(nargs, 1, "set_float_gemm");
  const char* was = onednn_linear() ? "onednn" : "torch";
  if (args[0] != Py_None) {
    const char* s = PyUnicode_AsUTF8(args[0]);
    if (!s) throw Fail{};
    const std::string name(s);
    need(name == "onednn" || name == "torch", g_arg_error, "float GEMM must be 'onednn' or 'torch', got '" + name + "'");
    g_onednn = name == "onednn";
  }
  return PyUnicode_FromString(was);
EXIT

ENTRY(py_isa)
  (void)args;
  (void)nargs;
  return PyUnicode_FromString(g_table->name);
EXIT

ENTRY(py_cpu_supports)
  need_args(nargs, 1, "cpu_supports");
  const char* s = PyUnicode_AsUTF8(args[0]);
  if (!s) throw Fail{};
  return PyBool_FromLong(cpu_has(s) && table_for(s) != nullptr);
EXIT

ENTRY(py_set_errors)
  need_args(nargs, 4, "set_errors");
  PyObject** slots[] = {&g_shape_error, &g_dtype_error, &g_layout_error, &g_arg_error};
  for (int i = 0; i < 4; ++i) {
    Py_INCREF(args[i]);
    *slots[i] = args[i];
  }
  Py_RETURN_NONE;
EXIT

// ===== the declared rows (ops.def): one module function per row, made at import from the rows' RowInfo ==========
// This unit reads no row: table.cpp describes each one (its arguments' kinds, names and field offsets in the row's
// struct), and one function, py_row, checks a call against that description, fills the struct and runs the kernel.
// So a new or edited row never recompiles this unit.

// dims [0, end) of t, size-1 dims skipped: whether they step one stride apart (each dim's stride the next one's
// times its size); *stride: that stride, or `dflt` when no dim is larger than 1
bool uniform(const at::Tensor& t, int64_t end, int64_t dflt, int64_t* stride) {
  int64_t rs = dflt, next = -1;
  for (int64_t d = end - 1; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (next < 0) rs = t.stride(d);
    else if (t.stride(d) != next) return false;
    next = t.stride(d) * t.size(d);
  }
  *stride = rs;
  return true;
}

// One tensor argument of a row call: its pointer's and row stride's fields in the struct, and its rows' strides:
// row h of token t at t * outer + h * inner elements, H rows a token (the size of the last dim before D). Rows one
// stride apart have outer == inner * H; token-strided heads (a fused qkv output's q heads) do not.
struct RowTensor {
  size_t off, ld_off;
  int64_t inner, outer;
};

// The arguments of one call of a row, checked in the row's order as its RowInfo says and written into the row's
// struct (buf): the first input fixes the dtype (float32 or bfloat16), the shape and D; the others must match it.
class RowCall {
 public:
  RowCall(const dtn::RowInfo& row, unsigned char* buf) : row_(row), op_(row.name), buf_(buf) {}

  void parse(PyObject* const* args, Py_ssize_t nargs) {
    NEED(nargs >= row_.nargs, g_arg_error, std::string(op_) + ": argument " + std::to_string(nargs + 1) + " (" +
         row_.args[nargs].name + ") is missing; it takes " + row_.spec);
    NEED(nargs == row_.nargs, g_arg_error, std::string(op_) + ": takes " + std::to_string(row_.nargs) +
         " arguments (" + row_.spec + "), got " + std::to_string(nargs));
    for (int i = 0; i < row_.nargs; ++i) {
      const dtn::RowArg& a = row_.args[i];
      PyObject* o = args[i];
      switch (a.kind) {
        case dtn::ARG_IN:
        case dtn::ARG_OUT: rows(a, o); break;
        case dtn::ARG_HALF: o == Py_None ? half(a) : rows(a, o); break;
        case dtn::ARG_VEC: vec(a, o); break;
        case dtn::ARG_F32: {
          const double v = PyFloat_AsDouble(o);
          if (v == -1.0 && PyErr_Occurred()) throw Fail{};
          put(a.off, float(v));
          break;
        }
        case dtn::ARG_I64: {
          const long long v = PyLong_AsLongLong(o);
          if (v == -1 && PyErr_Occurred()) throw Fail{};
          put(a.off, int64_t(v));
          break;
        }
        case dtn::ARG_BOOL: {
          const int v = PyObject_IsTrue(o);
          if (v < 0) throw Fail{};
          put(a.off, bool(v));
          break;
        }
      }
    }
  }

  // The call's struct completed (dtype, D, row strides) and what running it takes, fixed now: a bound call (bind)
  // keeps it and runs it each step with no parsing
  struct Plan {
    int64_t R, H, work, esz, size;  // work: a row's, for the thread split (4 D)
    bool two_level;
    std::vector<RowTensor> tensors;
  };

  Plan plan() {
    const int64_t D = shape_.back(), R = D ? first_->numel() / first_->size(-1) : 0;
    const int64_t H = shape_.size() >= 2 ? shape_[shape_.size() - 2] : 1, esz = dt_ == dtn::F32 ? 4 : 2;
    put(row_.off_dt, dt_);
    put(row_.off_D, D);
    bool two_level = false;
    for (const RowTensor& t : tensors_) {
      put(t.ld_off, t.inner);
      two_level |= H > 1 && t.outer != t.inner * H;
    }
    put(row_.off_R, two_level ? H : R);
    return {R, H, 4 * D, esz, int64_t(row_.size), two_level, std::move(tensors_)};
  }

  void run(dtn::RowFn kernel) { execute(plan(), buf_, kernel); }

  // Rows one stride apart: the kernel over every row, split over torch's threads. Token-strided heads: the kernel
  // over each token's H rows, tokens split over the threads. The GIL released meanwhile.
  static void execute(const Plan& p, const unsigned char* buf, dtn::RowFn kernel) {
    const int64_t R = p.R, H = p.H;
    Py_BEGIN_ALLOW_THREADS
    if (!p.two_level) {
      parallel_rows(R, p.work, [&](int64_t r0, int64_t r1) { kernel(buf, r0, r1); });
    } else {
      parallel_rows(H ? R / H : 0, p.work * H, [&](int64_t t0, int64_t t1) {
        alignas(16) unsigned char mine[kMaxRowArgs];
        std::memcpy(mine, buf, size_t(p.size));
        for (int64_t t = t0; t < t1; ++t) {
          for (const RowTensor& x : p.tensors) {  // each tensor's pointer at token t
            const char* q;
            std::memcpy(&q, buf + x.off, sizeof q);
            q += t * x.outer * p.esz;
            std::memcpy(mine + x.off, &q, sizeof q);
          }
          kernel(mine, 0, H);
        }
      });
    }
    Py_END_ALLOW_THREADS
  }

  static constexpr size_t kMaxRowArgs = 512;  // bytes of a row's struct (checked at import)

 private:
  template <class V>
  void put(size_t off, V v) { std::memcpy(buf_ + off, &v, sizeof v); }

  std::string shape_text() const {
    std::string s = "[";
    for (size_t i = 0; i < shape_.size(); ++i) s += (i ? ", " : "") + std::to_string(shape_[i]);
    return s + "]";
  }

  // DTN_IN / DTN_HALF / DTN_OUT: [..., D] of the first input's shape and dtype, the last dim dense
  void rows(const dtn::RowArg& a, PyObject* o) {
    const at::Tensor& t = any_tensor(o, op_, a.name);
    if (!first_) {
      first_ = &t;
      first_name_ = a.name;
      dt_ = float_dt(t, op_, a.name);
      NEED(t.dim() >= 1, g_shape_error, std::string(op_) + ": " + a.name + " must be [..., D], got a scalar");
      shape_.assign(t.sizes().begin(), t.sizes().end());
    } else {
      NEED(t.scalar_type() == first_->scalar_type(), g_dtype_error, std::string(op_) + ": " + a.name +
           " must have " + first_name_ + "'s dtype " + dtype_name(*first_) + ", got " + dtype_name(t));
      NEED(t.sizes() == c10::IntArrayRef(shape_), g_shape_error, std::string(op_) + ": " + a.name + " must have " +
           first_name_ + "'s shape " + shape_text() + (halved_ ? " (its last dim halved)" : "") + ", got " + dims(t));
    }
    const int64_t nd = t.dim(), H = nd >= 2 ? t.size(nd - 2) : 1;
    NEED(t.size(nd - 1) <= 1 || t.stride(nd - 1) == 1, g_layout_error, std::string(op_) + ": " + a.name + " " +
         dims(t) + " must be dense in its last dim");
    RowTensor r{a.off, a.ld_off, 0, 0};
    if (uniform(t, nd - 1, t.size(nd - 1), &r.inner)) {
      r.outer = r.inner * H;
    } else {
      r.inner = t.stride(nd - 2);
      NEED(uniform(t, nd - 2, r.inner * H, &r.outer), g_layout_error, std::string(op_) + ": " + a.name + " " +
           dims(t) + " must have its rows one stride apart, or be heads [..., T, H, D] one stride apart in a "
           "token, the tokens another");
    }
    put(a.off, static_cast<const void*>(t.data_ptr()));
    tensors_.push_back(r);
  }

  // DTN_HALF given None: the first input is the fused [..., 2D]; this input is its second half, the first its first
  void half(const dtn::RowArg& a) {
    NEED(first_ && tensors_.size() == 1 && !halved_, g_arg_error, std::string(op_) + ": DTN_HALF(" + a.name +
         ") must directly follow the first DTN_IN (ops.def)");
    const int64_t D2 = shape_.back();
    NEED(D2 % 2 == 0, g_shape_error, std::string(op_) + ": with " + a.name + " None, " + first_name_ +
         " must be the fused [..., 2D] (" + first_name_ + " then " + a.name + "), got " + dims(*first_));
    shape_.back() = D2 / 2;
    halved_ = true;
    const char* p = static_cast<const char*>(first_->data_ptr()) + (D2 / 2) * (dt_ == dtn::F32 ? 4 : 2);
    put(a.off, static_cast<const void*>(p));
    RowTensor r = tensors_[0];
    r.off = a.off, r.ld_off = a.ld_off;
    tensors_.push_back(r);
  }

  // DTN_VEC: [D], contiguous, of the first input's dtype
  void vec(const dtn::RowArg& a, PyObject* o) {
    NEED(first_ != nullptr, g_arg_error, std::string(op_) + ": its row must start with a DTN_IN (ops.def)");
    const at::Tensor& t = tensor(o, op_, a.name);
    NEED(t.scalar_type() == first_->scalar_type(), g_dtype_error, std::string(op_) + ": " + a.name + " must have " +
         first_name_ + "'s dtype " + dtype_name(*first_) + ", got " + dtype_name(t));
    NEED(t.dim() == 1 && t.size(0) == shape_.back(), g_shape_error, std::string(op_) + ": " + a.name +
         " must be [D = " + std::to_string(shape_.back()) + "], got " + dims(t));
    put(a.off, static_cast<const void*>(t.data_ptr()));
  }

  const dtn::RowInfo& row_;
  const char* op_;
  unsigned char* buf_;
  const at::Tensor* first_ = nullptr;
  const char* first_name_ = "";
  int dt_ = 0;
  bool halved_ = false;
  std::vector<int64_t> shape_;  // the first input's shape, its last dim halved by a DTN_HALF given None
  std::vector<RowTensor> tensors_;
};

const dtn::RowInfo* g_rows = nullptr;  // the rows of ops.def (table.cpp) and their number
int g_nrows = 0;

// The module function of row `self` (its index in g_rows, a Python int): checks, then the kernel of the ISA in use
PyObject* py_row(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  try {
    const Py_ssize_t i = PyLong_AsSsize_t(self);
    if (i < 0 || i >= g_nrows) throw Fail{};
    alignas(16) unsigned char buf[RowCall::kMaxRowArgs] = {};
    RowCall c(g_rows[i], buf);
    c.parse(args, nargs);
    c.run(g_table->ops[i]);
    Py_RETURN_NONE;
  } catch (const Fail&) {
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// Adds one function per row to the module: its name and doc from the row, py_row with the row's index as self
bool add_rows(PyObject* mod) {
  g_rows = dtn::rows(&g_nrows);
  static std::vector<PyMethodDef> defs;  // alive as long as the functions: never freed
  defs.assign(size_t(g_nrows), PyMethodDef{});
  for (int i = 0; i < g_nrows; ++i) {
    const dtn::RowInfo& r = g_rows[i];
    if (r.size > RowCall::kMaxRowArgs) {
      PyErr_Format(PyExc_ImportError, "the struct of DTN_OP %s is %zu bytes, more than binding.cpp's %zu", r.name,
                   r.size, RowCall::kMaxRowArgs);
      return false;
    }
    defs[size_t(i)] = {r.name, (PyCFunction)(void (*)())py_row, METH_FASTCALL, r.doc};
    PyObject* index = PyLong_FromLong(i);
    PyObject* fn = index ? PyCFunction_NewEx(&defs[size_t(i)], index, nullptr) : nullptr;
    Py_XDECREF(index);
    if (!fn || PyModule_AddObject(mod, r.name, fn) < 0) {
      Py_XDECREF(fn);
      return false;
    }
  }
  return true;
}

// the module's hand-written functions: one method per DTN_ENTRY row of entries.def, each defined in this file as
// ENTRY(py_<name>)
#define DTN_ENTRY(name, ops, doc) PyObject* py_##name(PyObject*, PyObject* const*, Py_ssize_t);
#include "slot_rows.h"

PyMethodDef methods[] = {
#define DTN_ENTRY(name, ops, doc) {#name, (PyCFunction)(void (*)())py_##name, METH_FASTCALL, doc},
#include "slot_rows.h"
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dtorch_native", "dtorch native CPU kernels", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__dtorch_native() {
  for (const char* isa : {"avx512", "avx2", "portable"}) {  // a table without a kernel of the list: a broken build
    const char* missing = nullptr;
    dtn::table(isa, &missing);
    if (missing) {
      PyErr_Format(PyExc_ImportError, "the %s kernel table lacks %s: isa_%s.cpp must define each kernel of ops.def "
                   "and entries.def in its namespace kernels, and build.py link one object per group", isa, missing, isa);
      return nullptr;
    }
  }
  g_table = cpu_has("avx512") && table_for("avx512") ? table_for("avx512")
          : cpu_has("avx2") && table_for("avx2")     ? table_for("avx2")
                                                     : table_for("portable");
  if (!g_table) {
    PyErr_SetString(PyExc_ImportError, "no portable kernel table was linked (build.py links isa_portable.cpp)");
    return nullptr;
  }
  PyObject* mod = PyModule_Create(&module);
  if (mod && !add_rows(mod)) Py_CLEAR(mod);
  return mod;
}

// ===== KV cache and quantized embedding: paged_attention, cache_store, qembedding ===========================
// llm.flash_attention_with_kvcache runs in the ISA units (attention.h, Table::attend); storing a step's keys and
// gathering embedding rows are copies and a dequantization of a few rows, plain C++ here.
namespace {

// the row stride of a [T, H, D] view whose last dim is dense; its head stride goes to *head
int64_t token_stride(const at::Tensor& t, int64_t* head, const char* op, const char* name) {
  NEED(t.dim() == 3 && (t.stride(2) == 1 || t.size(2) == 1), g_layout_error,
       std::string(op) + ": " + name + " " + dims(t) + " must be [T, H, D] with D dense");
  *head = t.stride(1);
  return t.stride(0);
}

thread_local std::vector<dtn::AttnItem> t_items;

// paged_attention(q [T, H, D], k_cache, v_cache [blocks, block_size, Hkv, D], cu_seqlens_q int32 [N + 1],
// seqlens_k int32 [N], block_table int32 [N, max_blocks], out [T, H, D], causal bool, scale float, window int (0:
// none)); q and out may be token/head-strided views (D dense); D a multiple of 16 up to 256
ENTRY(py_paged_attention)
  const char* op = "paged_attention";
  need_args(nargs, 10, op);
  const at::Tensor& q = any_tensor(args[0], op, "q");
  const at::Tensor& kc = tensor(args[1], op, "k_cache");
  const at::Tensor& vc = tensor(args[2], op, "v_cache");
  const at::Tensor& cu = tensor(args[3], op, "cu_seqlens_q");
  const at::Tensor& lens = tensor(args[4], op, "seqlens_k");
  const at::Tensor& table = tensor(args[5], op, "block_table");
  const at::Tensor& out = any_tensor(args[6], op, "out");
  const bool causal = PyObject_IsTrue(args[7]);
  const double scale = PyFloat_AsDouble(args[8]);
  if (scale == -1.0 && PyErr_Occurred()) throw Fail{};
  const long long window = PyLong_AsLongLong(args[9]);
  if (window == -1 && PyErr_Occurred()) throw Fail{};
  NEED(window >= 0, g_arg_error, std::string(op) + ": window must be >= 0 (0: none), got " + std::to_string(window));
  const int dt = float_dt(q, op, "q"), cdt = float_dt(kc, op, "k_cache");
  NEED(out.scalar_type() == q.scalar_type(), g_dtype_error, std::string(op) + ": out must have q's dtype " +
       dtype_name(q) + ", got " + dtype_name(out));
  NEED(vc.scalar_type() == kc.scalar_type(), g_dtype_error, std::string(op) + ": v_cache must have k_cache's dtype " +
       dtype_name(kc) + ", got " + dtype_name(vc));
  for (const at::Tensor* t : {&cu, &lens, &table}) need_dtype(*t, at::kInt, op, "cu_seqlens_q/seqlens_k/block_table");
  int64_t q_head = 0, o_head = 0;
  const int64_t q_tok = token_stride(q, &q_head, op, "q"), o_tok = token_stride(out, &o_head, op, "out");
  NEED(kc.dim() == 4 && vc.sizes() == kc.sizes() && out.sizes() == q.sizes(), g_shape_error,
       std::string(op) + ": need caches [blocks, block_size, Hkv, D] of one shape and out like q; got q " + dims(q) +
       ", k_cache " + dims(kc) + ", v_cache " + dims(vc) + ", out " + dims(out));
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), nblocks = kc.size(0), bs = kc.size(1), hkv = kc.size(2);
  NEED(kc.size(3) == D && hkv > 0 && H % hkv == 0, g_shape_error, std::string(op) + ": q " + dims(q) +
       " needs caches [..., Hkv, D] with H a multiple of Hkv; got " + dims(kc));
  NEED(D % 16 == 0 && D > 0 && D <= 256, g_layout_error,
       std::string(op) + ": head dim " + std::to_string(D) + " is not a multiple of 16 up to 256");
  const int64_t N = lens.size(0);
  NEED(lens.dim() == 1 && cu.dim() == 1 && cu.size(0) == N + 1 && table.dim() == 2 && table.size(0) == N,
       g_shape_error, std::string(op) + ": need seqlens_k [N], cu_seqlens_q [N + 1], block_table [N, max_blocks]; "
       "got " + dims(lens) + ", " + dims(cu) + ", " + dims(table));
  // the values decide which memory is read: checked here (O(N + blocks used)), then trusted
  const int32_t *cp = cu.data_ptr<int32_t>(), *lp = lens.data_ptr<int32_t>(), *tp = table.data_ptr<int32_t>();
  const int64_t mb = table.size(1), G = H / hkv;
  NEED(cp[0] == 0 && cp[N] == T, g_arg_error, std::string(op) + ": cu_seqlens_q must rise from 0 to T = " +
       std::to_string(T));
  std::vector<dtn::AttnItem>& items = t_items;
  items.clear();
  double work = 0;  // multiply-adds of QK^T (an upper bound under causal)
  for (int64_t s = 0; s < N; ++s) {
    const int64_t nq = cp[s + 1] - cp[s], n = lp[s], used = (n + bs - 1) / bs;
    NEED(nq >= 0 && n >= 0 && used <= mb, g_arg_error, std::string(op) + ": sequence " + std::to_string(s) +
         " has " + std::to_string(nq) + " queries and " + std::to_string(n) + " keys, more than its " +
         std::to_string(mb) + " blocks of " + std::to_string(bs) + " hold (or a negative count)");
    const int64_t oldest = window > 0 ? std::max<int64_t>(0, n - nq - window + 1) : 0;  // blocks before: unread
    for (int64_t b = oldest / bs; b < used; ++b)
      NEED(tp[s * mb + b] >= 0 && tp[s * mb + b] < nblocks, g_arg_error, std::string(op) + ": block_table[" +
           std::to_string(s) + ", " + std::to_string(b) + "] = " + std::to_string(tp[s * mb + b]) +
           " is outside 0.." + std::to_string(nblocks - 1));
    const int64_t rows = nq * G;
    for (int64_t h = 0; h < hkv; ++h)
      for (int64_t r0 = 0; r0 < rows; r0 += 16)
        items.push_back({int32_t(s), int32_t(h), int32_t(r0), int32_t(std::min<int64_t>(rows, r0 + 16))});
    work += double(rows) * double(hkv) * double(window > 0 ? std::min<int64_t>(n, window + nq) : n) * double(D);
  }
  const dtn::AttnCall c{q.data_ptr(), q_tok, q_head, kc.data_ptr(), vc.data_ptr(), bs, hkv, out.data_ptr(), o_tok,
                        o_head, cp, lp, tp, mb, dt, D, G, float(scale), causal, int64_t(window), cdt};
  const dtn::Table* at = g_table;
  const dtn::AttnItem* ip = items.data();
  const int64_t ni = int64_t(items.size());
  Py_BEGIN_ALLOW_THREADS
  if (work < double(1 << 17) || ni < 2) {  // a decode step's few microseconds: no fork
    at->attend(c, ip, 0, ni);
  } else {
    at::parallel_for(0, ni, 1, [&](int64_t i0, int64_t i1) { at->attend(c, ip, i0, i1); });
  }
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
EXIT

// n values from element `from` of src to element `to` of dst, float32 -> bf16 (cdt BF16) or bf16 -> float32
void convert_row(char* dst, const char* src, int64_t to, int64_t from, int64_t n, int cdt) {
  if (cdt == dtn::BF16) {
    const float* a = reinterpret_cast<const float*>(src) + from;
    c10::BFloat16* b = reinterpret_cast<c10::BFloat16*>(dst) + to;
    for (int64_t i = 0; i < n; ++i) b[i] = c10::BFloat16(a[i]);
  } else {
    const c10::BFloat16* a = reinterpret_cast<const c10::BFloat16*>(src) + from;
    float* b = reinterpret_cast<float*>(dst) + to;
    for (int64_t i = 0; i < n; ++i) b[i] = float(a[i]);
  }
}

// cache_store(key, value [T, Hkv, D], k_cache, v_cache [blocks, block_size, Hkv, D], slots int32/int64 [T]):
// row t to flat cache row slots[t]; a negative slot is skipped. key/value rows may be strided (heads dense).
// cache_store's call checked, as what runs it (py_cache_store runs it at once, bind keeps it); the slots are read,
// and checked, at each run
auto cache_store_run(PyObject* const* args, Py_ssize_t nargs) {
  const char* op = "cache_store";
  need_args(nargs, 5, op);
  const at::Tensor& k = any_tensor(args[0], op, "key");
  const at::Tensor& v = any_tensor(args[1], op, "value");
  const at::Tensor& kc = tensor(args[2], op, "k_cache");
  const at::Tensor& vc = tensor(args[3], op, "v_cache");
  const at::Tensor& slots = tensor(args[4], op, "slot_mapping");
  NEED(v.scalar_type() == k.scalar_type(), g_dtype_error, std::string(op) + ": value must have key's dtype " +
       dtype_name(k) + ", got " + dtype_name(v));
  NEED(vc.scalar_type() == kc.scalar_type(), g_dtype_error, std::string(op) + ": v_cache must have k_cache's dtype " +
       dtype_name(kc) + ", got " + dtype_name(vc));
  const int kdt = float_dt(k, op, "key"), cdt = float_dt(kc, op, "k_cache");
  NEED(slots.scalar_type() == at::kLong || slots.scalar_type() == at::kInt, g_dtype_error,
       std::string(op) + ": slot_mapping must be int64 or int32, got " + dtype_name(slots));
  NEED(k.dim() == 3 && v.sizes() == k.sizes() && kc.dim() == 4 && vc.sizes() == kc.sizes() &&
       k.size(1) == kc.size(2) && k.size(2) == kc.size(3) && slots.dim() == 1 && slots.size(0) == k.size(0),
       g_shape_error, std::string(op) + ": need key/value [T, Hkv, D], caches [blocks, block_size, Hkv, D] and "
       "slot_mapping [T]; got " + dims(k) + ", " + dims(kc) + ", " + dims(slots));
  const int64_t T = k.size(0), rows = kc.size(0) * kc.size(1);
  const int64_t ldk = row_stride(k, 2, op, "key"), ldv = row_stride(v, 2, op, "value");
  const int64_t esz = kc.element_size(), width = k.size(1) * k.size(2);
  const char *kp = static_cast<const char*>(k.data_ptr()), *vp = static_cast<const char*>(v.data_ptr());
  char *kcp = static_cast<char*>(kc.data_ptr()), *vcp = static_cast<char*>(vc.data_ptr());
  const bool wide = slots.scalar_type() == at::kLong;
  const void* sp = slots.data_ptr();
  return [=] {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t s = wide ? static_cast<const int64_t*>(sp)[t] : static_cast<const int32_t*>(sp)[t];
      if (s < 0) continue;
      NEED(s < rows, g_arg_error, std::string(op) + ": slot " + std::to_string(s) + " is past the cache's " +
           std::to_string(rows) + " rows");
      if (kdt == cdt) {
        std::memcpy(kcp + s * width * esz, kp + t * ldk * esz, size_t(width * esz));
        std::memcpy(vcp + s * width * esz, vp + t * ldv * esz, size_t(width * esz));
      } else {  // rounded to a bf16 cache, or widened to a float32 one, as torch's .to() does (c10's conversions)
        convert_row(kcp, kp, s * width, t * ldk, width, cdt);
        convert_row(vcp, vp, s * width, t * ldv, width, cdt);
      }
    }
  };
}

ENTRY(py_cache_store)
  cache_store_run(args, nargs)();
  Py_RETURN_NONE;
EXIT

// bind(fn, *args): the call fn(*args) of a declared row's module function, rope or cache_store, checked now (the
// errors fn would raise), as a BoundCall that runs it with no arguments
ENTRY(py_bind)
  NEED(nargs >= 1 && PyCFunction_Check(args[0]), g_arg_error,
       "bind: its first argument must be a declared row's module function, rope or cache_store");
  const PyCFunction f = PyCFunction_GET_FUNCTION(args[0]);
  if (f == (PyCFunction)(void (*)())py_rope) return make_bound(rope_run(args + 1, nargs - 1), args + 1, nargs - 1);
  if (f == (PyCFunction)(void (*)())py_cache_store)
    return make_bound(cache_store_run(args + 1, nargs - 1), args + 1, nargs - 1);
  NEED(f == (PyCFunction)(void (*)())py_row, g_arg_error,
       "bind: its first argument must be a declared row's module function, rope or cache_store");
  const Py_ssize_t i = PyLong_AsSsize_t(PyCFunction_GET_SELF(args[0]));
  if (i < 0 || i >= g_nrows) throw Fail{};
  struct alignas(16) Buf {
    unsigned char b[RowCall::kMaxRowArgs];
  };
  Buf buf{};
  RowCall c(g_rows[i], buf.b);
  c.parse(args + 1, nargs - 1);
  RowCall::Plan plan = c.plan();
  return make_bound([plan = std::move(plan), buf, i] { RowCall::execute(plan, buf.b, g_table->ops[i]); }, args + 1,
                    nargs - 1);
EXIT

// qembedding(w uint8 [V, row bytes] (any format), ids int32/int64 [...], fmt int, vocab_start int | None,
// out [..., E] f32/bf16): out[t] = dequantize(w[ids[t] - vocab_start]); with vocab_start, ids outside
// [vocab_start, vocab_start + V) give zero rows
ENTRY(py_qembedding)
  const char* op = "qembedding";
  need_args(nargs, 5, op);
  const at::Tensor& w = tensor(args[0], op, "w");
  const at::Tensor& ids = tensor(args[1], op, "ids");
  const long fmt = PyLong_AsLong(args[2]);
  if (fmt == -1 && PyErr_Occurred()) throw Fail{};
  const bool sharded = args[3] != Py_None;
  const long long start = sharded ? PyLong_AsLongLong(args[3]) : 0;
  if (start == -1 && PyErr_Occurred()) throw Fail{};
  const at::Tensor& out = tensor(args[4], op, "out");
  const int dt = float_dt(out, op, "out");
  need_dtype(w, at::kByte, op, "w");
  NEED(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt, g_dtype_error,
       std::string(op) + ": ids must be int64 or int32, got " + dtype_name(ids));
  const int64_t E = out.dim() ? out.size(-1) : 0, V = w.dim() == 2 ? w.size(0) : 0, M = ids.numel();
  const Sizes sz = sizes(int(fmt), E);
  const int64_t rb = sz.qs + sz.d + sz.aux;
  NEED(w.dim() == 2 && E > 0 && E % sz.block == 0 && w.size(1) == rb && out.numel() == M * E, g_shape_error,
       std::string(op) + ": need w [V, row bytes of E], out [..., E] with E a multiple of " +
       std::to_string(sz.block) + " and one row per id; got w " + dims(w) + ", ids " + dims(ids) + ", out " +
       dims(out));

  const bool wide = ids.scalar_type() == at::kLong;
  const void* idp = ids.data_ptr();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  std::vector<float> buf(dt == dtn::F32 ? 0 : size_t(E));
  // each row: the kernel table's dequantization (packed order, the same float32 operations as layouts.dequantize),
  // put back in weight order
  const dtn::QWeight qw{int(fmt), E, wp, rb, reinterpret_cast<const uint16_t*>(wp + sz.qs), rb / 2, wp + sz.qs + sz.d,
                        rb};
  const std::vector<int64_t> order = kernel_order(int(fmt), E);
  std::vector<float> packed_order(static_cast<size_t>(E));
  for (int64_t t = 0; t < M; ++t) {
    const int64_t r = (wide ? static_cast<const int64_t*>(idp)[t] : static_cast<const int32_t*>(idp)[t]) - start;
    NEED(sharded || (r >= 0 && r < V), g_arg_error, std::string(op) + ": id " + std::to_string(r) +
         " is outside the vocabulary of " + std::to_string(V));
    float* x = dt == dtn::F32 ? out.data_ptr<float>() + t * E : buf.data();
    if (r < 0 || r >= V) {
      std::fill(x, x + E, 0.f);
    } else {
      g_table->dequant(qw, r, r + 1, packed_order.data());
      for (int64_t i = 0; i < E; ++i) x[order[size_t(i)]] = packed_order[size_t(i)];
    }
    if (dt == dtn::BF16) {
      c10::BFloat16* o = out.data_ptr<c10::BFloat16>() + t * E;
      for (int64_t e = 0; e < E; ++e) o[e] = c10::BFloat16(x[e]);
    }
  }
  Py_RETURN_NONE;
EXIT

}  // namespace

// ===== decode steps of hybrid models: conv_update, gdn_step (recurrent.h), moe_decode ========================
namespace {

// Pool rows of a step's B batch rows: indices [B] int32/int64 (each in 0..P-1), or b itself when args is None;
// write[b] = 1 unless a later batch row names the same row (padding rows may share one: the last one writes)
void step_rows(PyObject* arg, int64_t B, int64_t P, const char* op, std::vector<int64_t>& rows,
               std::vector<uint8_t>& write) {
  rows.resize(size_t(B));
  write.assign(size_t(B), 1);
  if (arg == Py_None) {
    NEED(P == B, g_shape_error, std::string(op) + ": without state_indices the state holds one row per batch row (" +
         std::to_string(B) + "), got " + std::to_string(P));
    for (int64_t b = 0; b < B; ++b) rows[size_t(b)] = b;
    return;
  }
  const at::Tensor& idx = tensor(arg, op, "state_indices");
  NEED(idx.scalar_type() == at::kLong || idx.scalar_type() == at::kInt, g_dtype_error,
       std::string(op) + ": state_indices must be int64 or int32, got " + dtype_name(idx));
  NEED(idx.dim() == 1 && idx.size(0) == B, g_shape_error, std::string(op) + ": state_indices must be [B = " +
       std::to_string(B) + "], got " + dims(idx));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t r = idx.scalar_type() == at::kLong ? idx.data_ptr<int64_t>()[b] : idx.data_ptr<int32_t>()[b];
    NEED(r >= 0 && r < P, g_arg_error, std::string(op) + ": state_indices[" + std::to_string(b) + "] = " +
         std::to_string(r) + " is outside the pool's rows 0.." + std::to_string(P - 1));
    rows[size_t(b)] = r;
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c = b + 1; c < B && write[size_t(b)]; ++c) write[size_t(b)] = rows[size_t(c)] != rows[size_t(b)];
}

thread_local std::vector<int64_t> t_rows;
thread_local std::vector<uint8_t> t_write;

// conv_update(x [B, D], weight [D, W], bias [D] | None, state [P, D, S], state_indices [B] | None, out [B, D],
// silu bool): one step of llm.causal_conv1d_update (dtn::ConvCall); x and out may be row-strided, one dtype for all
ENTRY(py_conv_update)
  const char* op = "conv_update";
  need_args(nargs, 7, op);
  const at::Tensor& x = any_tensor(args[0], op, "x");
  const at::Tensor& w = tensor(args[1], op, "weight");
  const bool has_bias = args[2] != Py_None;
  const at::Tensor* bias = has_bias ? &tensor(args[2], op, "bias") : nullptr;
  const at::Tensor& state = tensor(args[3], op, "conv_state");
  const at::Tensor& out = any_tensor(args[5], op, "out");
  const bool silu = PyObject_IsTrue(args[6]);
  const int dt = float_dt(x, op, "x");
  for (const at::Tensor* t : {&w, bias, &state, &out})
    NEED(!t || t->scalar_type() == x.scalar_type(), g_dtype_error, std::string(op) + ": weight, bias, conv_state "
         "and out must have x's dtype " + dtype_name(x) + ", got " + dtype_name(*t));
  NEED(x.dim() == 2 && w.dim() == 2 && state.dim() == 3 && out.sizes() == x.sizes() && w.size(0) == x.size(1) &&
       state.size(1) == x.size(1) && w.size(1) >= 1 && state.size(2) >= w.size(1) - 1 && state.size(2) >= 1 &&
       (!bias || (bias->dim() == 1 && bias->size(0) == x.size(1))), g_shape_error,
       std::string(op) + ": need x and out [B, D], weight [D, W], bias [D], conv_state [P, D, S >= max(W - 1, 1)]; "
       "got x " + dims(x) + ", weight " + dims(w) + ", conv_state " + dims(state) + ", out " + dims(out));
  const int64_t B = x.size(0), D = x.size(1);
  const int64_t ldx = row_stride(x, 1, op, "x"), ldo = row_stride(out, 1, op, "out");
  step_rows(args[4], B, state.size(0), op, t_rows, t_write);
  const dtn::ConvCall c{x.data_ptr(), ldx, w.data_ptr(), has_bias ? bias->data_ptr() : nullptr, w.size(1),
                        state.data_ptr(), state.size(2), t_rows.data(), t_write.data(), out.data_ptr(), ldo, dt, B, D,
                        silu};
  const dtn::Table* st = g_table;
  Py_BEGIN_ALLOW_THREADS
  if (B * D < (1 << 15)) {  // a decode step's few microseconds: no fork
    st->conv_update(c, 0, D);
  } else {
    at::parallel_for(0, D, std::max<int64_t>(64, (int64_t(1) << 14) / std::max<int64_t>(1, B)),
                     [&](int64_t d0, int64_t d1) { st->conv_update(c, d0, d1); });
  }
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
EXIT

// the element strides of t [B, 1, N, L] per batch row and per head (dim 2); L dense
void step_strides(const at::Tensor& t, int64_t* sb, int64_t* sh, const char* op, const char* name) {
  NEED(t.dim() >= 3 && t.size(1) == 1 && (t.dim() == 3 || t.stride(3) == 1 || t.size(3) == 1), g_layout_error,
       std::string(op) + ": " + name + " " + dims(t) + " must be [B, 1, heads(, dim)] with the last dim dense");
  *sb = t.stride(0);
  *sh = t.stride(2);
}

thread_local std::vector<int64_t> t_items_gdn;

// gdn_step(q, k [B, 1, Hk, K], v [B, 1, H, V], g [B, 1, H] f32, beta [B, 1, H], state_in [N, H, K, V] f32 | None,
// state_out like state_in | None, state_indices [B] | None, o [B, 1, H, V], scale float, l2norm bool): one step
// of llm.gated_delta_net (dtn::GdnCall); q/k/v/g/beta/o may be strided views, the last dim dense. With
// state_indices, state_out is state_in (in place) or None.
ENTRY(py_gdn_step)
  const char* op = "gdn_step";
  need_args(nargs, 11, op);
  const at::Tensor& q = any_tensor(args[0], op, "q");
  const at::Tensor& k = any_tensor(args[1], op, "k");
  const at::Tensor& v = any_tensor(args[2], op, "v");
  const at::Tensor& g = any_tensor(args[3], op, "g");
  const at::Tensor& beta = any_tensor(args[4], op, "beta");
  const at::Tensor* sin = args[5] != Py_None ? &tensor(args[5], op, "initial_state") : nullptr;
  const at::Tensor* sout = args[6] != Py_None ? &tensor(args[6], op, "final_state") : nullptr;
  const at::Tensor& o = any_tensor(args[8], op, "o");
  const double scale = PyFloat_AsDouble(args[9]);
  if (scale == -1.0 && PyErr_Occurred()) throw Fail{};
  const bool l2norm = PyObject_IsTrue(args[10]);
  const int dt = float_dt(q, op, "q"), beta_dt = float_dt(beta, op, "beta");
  for (const at::Tensor* t : {&k, &v, &o})
    NEED(t->scalar_type() == q.scalar_type(), g_dtype_error, std::string(op) + ": k, v and o must have q's dtype " +
         dtype_name(q) + ", got " + dtype_name(*t));
  need_dtype(g, at::kFloat, op, "g");
  for (const at::Tensor* t : {sin, sout})
    if (t) need_dtype(*t, at::kFloat, op, "initial_state/final_state");
  NEED(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 && o.sizes() == v.sizes() && v.size(0) == q.size(0) &&
       g.dim() == 3 && beta.sizes() == g.sizes() && g.size(0) == q.size(0) && g.size(2) == v.size(2) &&
       q.size(2) > 0 && v.size(2) % q.size(2) == 0, g_shape_error,
       std::string(op) + ": need q, k [B, 1, Hk, K], v and o [B, 1, H, V] (H a multiple of Hk), g and beta [B, 1, H]; "
       "got q " + dims(q) + ", k " + dims(k) + ", v " + dims(v) + ", g " + dims(g) + ", beta " + dims(beta) +
       ", o " + dims(o));
  const int64_t B = q.size(0), Hk = q.size(2), K = q.size(3), H = v.size(2), V = v.size(3);
  NEED(K <= dtn::kGdnMaxDim && V <= dtn::kGdnMaxDim && V % 16 == 0 && K > 0 && V > 0, g_layout_error,
       std::string(op) + ": K = " + std::to_string(K) + " and V = " + std::to_string(V) + " must be at most " +
       std::to_string(dtn::kGdnMaxDim) + ", V a multiple of 16");
  const at::Tensor* st = sin ? sin : sout;
  NEED(!st || (st->dim() == 4 && st->size(1) == H && st->size(2) == K && st->size(3) == V &&
               (!sin || !sout || sout->sizes() == sin->sizes())), g_shape_error,
       std::string(op) + ": the states must be [N, H, K, V] = [N, " + std::to_string(H) + ", " + std::to_string(K) +
       ", " + std::to_string(V) + "], both of one shape; got " + dims(*st));
  const bool pooled = args[7] != Py_None;
  NEED(!pooled || !sout || (sin && sin->data_ptr() == sout->data_ptr()), g_arg_error,
       std::string(op) + ": with state_indices the final state must be the initial state (in place) or None");
  step_rows(args[7], B, st ? st->size(0) : B, op, t_rows, t_write);
  dtn::GdnCall c{};
  step_strides(q, &c.q_b, &c.q_h, op, "q");
  step_strides(k, &c.k_b, &c.k_h, op, "k");
  step_strides(v, &c.v_b, &c.v_h, op, "v");
  step_strides(o, &c.o_b, &c.o_h, op, "o");
  step_strides(g, &c.g_b, &c.g_h, op, "g");
  step_strides(beta, &c.beta_b, &c.beta_h, op, "beta");
  c.q = q.data_ptr(), c.k = k.data_ptr(), c.v = v.data_ptr(), c.g = g.data_ptr<float>(), c.beta = beta.data_ptr();
  c.beta_dt = beta_dt;
  c.state_in = sin ? sin->data_ptr<float>() : nullptr;
  c.state_out = sout ? sout->data_ptr<float>() : nullptr;
  c.rows = t_rows.data(), c.write = t_write.data(), c.o = o.data_ptr();
  c.dt = dt, c.H = H, c.Hk = Hk, c.K = K, c.V = V, c.scale = float(scale), c.l2norm = l2norm;
  // items b * H + h: the rows that are only read first, then those written (padding rows that share a pool row)
  std::vector<int64_t>& items = t_items_gdn;
  items.clear();
  for (int pass = 0; pass < 2; ++pass)
    for (int64_t b = 0; b < B; ++b)
      if (bool(t_write[size_t(b)]) == bool(pass))
        for (int64_t h = 0; h < H; ++h) items.push_back(b * H + h);
  const int64_t split = int64_t(std::count(t_write.begin(), t_write.end(), 0)) * H, n = B * H;
  const dtn::Table* tb = g_table;
  const int64_t* ip = items.data();
  Py_BEGIN_ALLOW_THREADS
  for (auto [i0, i1] : {std::pair<int64_t, int64_t>{0, split}, {split, n}}) {
    if (i1 - i0 < 2) tb->gdn_step(c, ip, i0, i1);
    else at::parallel_for(i0, i1, 1, [&](int64_t a, int64_t e) { tb->gdn_step(c, ip, a, e); });
  }
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
EXIT

thread_local std::vector<float> t_moe;

// moe_decode(x [1, H], w_gate_up [E, 2I, H], w_down [E, H, I] (x's dtype), weights [1, k] f32/bf16, ids [1, k]
// int64/int32, expert_start int, out [1, H]): one token through its selected experts, ids outside
// expert_start .. expert_start + E - 1 skipped: out = sum_j weights[j] W_down (silu(W_gate x) * (W_up x)) in
// float32, rounded once. The gate/up rows of all experts are one split over threads, then the down rows.
ENTRY(py_moe_decode)
  const char* op = "moe_decode";
  need_args(nargs, 7, op);
  const at::Tensor& x = tensor(args[0], op, "x");
  const at::Tensor& wgu = tensor(args[1], op, "w_gate_up");
  const at::Tensor& wd = tensor(args[2], op, "w_down");
  const at::Tensor& rw = tensor(args[3], op, "weights");
  const at::Tensor& ids = tensor(args[4], op, "ids");
  const long long start = PyLong_AsLongLong(args[5]);
  if (start == -1 && PyErr_Occurred()) throw Fail{};
  const at::Tensor& out = tensor(args[6], op, "out");
  const int xdt = float_dt(x, op, "x"), rdt = float_dt(rw, op, "weights");
  for (const at::Tensor* t : {&wgu, &wd, &out})
    NEED(t->scalar_type() == x.scalar_type(), g_dtype_error, std::string(op) + ": w_gate_up, w_down and out must "
         "have x's dtype " + dtype_name(x) + ", got " + dtype_name(*t));
  NEED(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt, g_dtype_error,
       std::string(op) + ": ids must be int64 or int32, got " + dtype_name(ids));
  NEED(x.dim() == 2 && x.size(0) == 1 && wgu.dim() == 3 && wd.dim() == 3 && wgu.size(0) == wd.size(0) &&
       wgu.size(2) == x.size(1) && wd.size(1) == x.size(1) && wgu.size(1) == 2 * wd.size(2) &&
       out.sizes() == x.sizes() && ids.dim() == 2 && ids.size(0) == 1 && rw.sizes() == ids.sizes(), g_shape_error,
       std::string(op) + ": need x and out [1, H], w_gate_up [E, 2I, H], w_down [E, H, I], weights and ids [1, k]; "
       "got x " + dims(x) + ", w_gate_up " + dims(wgu) + ", w_down " + dims(wd) + ", ids " + dims(ids) +
       ", out " + dims(out));
  const int64_t H = x.size(1), E = wgu.size(0), I = wd.size(2), k = ids.size(1);
  std::vector<int64_t> ex;  // the selected local experts and their router weights
  std::vector<float> ew;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t e = (ids.scalar_type() == at::kLong ? ids.data_ptr<int64_t>()[j] : ids.data_ptr<int32_t>()[j]) -
                      start;
    if (e < 0 || e >= E) continue;
    ex.push_back(e);
    ew.push_back(rdt == dtn::F32 ? rw.data_ptr<float>()[j] : float(rw.data_ptr<c10::BFloat16>()[j]));
  }
  const int64_t n = int64_t(ex.size());
  std::vector<float>& ws = t_moe;  // gate_up [n, 2I], h [n, I], y [n, H], float32
  if (int64_t(ws.size()) < n * (3 * I + H)) ws.resize(size_t(n * (3 * I + H)));
  float *gu = ws.data(), *hp = gu + n * 2 * I, *y = hp + n * I;
  const dtn::Table* tb = g_table;
  const int64_t esz = xdt == dtn::F32 ? 4 : 2;
  const void* xp = x.data_ptr();
  const char *gup = static_cast<const char*>(wgu.data_ptr()), *dp = static_cast<const char*>(wd.data_ptr());
  void* op_ = out.data_ptr();
  const int64_t* exp_ = ex.data();
  const float* ewp = ew.data();
  Py_BEGIN_ALLOW_THREADS
  // rows r of the n stacked [2I, H] gate/up matrices
  parallel_rows(n * 2 * I, H, [&](int64_t r0, int64_t r1) {
    for (int64_t j = r0 / (2 * I); j < n && j * 2 * I < r1; ++j) {
      const int64_t a = std::max(r0, j * 2 * I) - j * 2 * I, b = std::min(r1, (j + 1) * 2 * I) - j * 2 * I;
      tb->gemv(xp, xdt, 1, gup + exp_[j] * 2 * I * H * esz, xdt, H, a, b, gu + j * 2 * I, dtn::F32, 2 * I);
    }
  });
  tb->silu_mul(gu, gu + I, 2 * I, 2 * I, hp, dtn::F32, 0, n, I);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < I; ++i) hp[j * I + i] *= ewp[j];
  parallel_rows(H, n * I, [&](int64_t r0, int64_t r1) {
    for (int64_t j = 0; j < n; ++j)
      tb->gemv(hp + j * I, dtn::F32, 1, dp + exp_[j] * H * I * esz, xdt, I, r0, r1, y + j * H, dtn::F32, H);
    for (int64_t r = r0; r < r1; ++r) {
      float acc = 0.f;
      for (int64_t j = 0; j < n; ++j) acc += y[j * H + r];
      if (xdt == dtn::F32) static_cast<float*>(op_)[r] = acc;
      else static_cast<c10::BFloat16*>(op_)[r] = c10::BFloat16(acc);
    }
  });
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
EXIT

}  // namespace

// ===== a decode step's small gates: gdn_gates ================================================================
// Tiny [T, H] math whose cost under torch is its ops' overheads. Where the torch kernel's exact bits are the
// contract (beta = b.sigmoid()), the same ATen code computes them (at::sigmoid_out).

namespace {

// element i of a float32 / bf16 array
inline float elem(const void* p, int dt, int64_t i) {
  return dt == dtn::F32 ? static_cast<const float*>(p)[i] : float(static_cast<const c10::BFloat16*>(p)[i]);
}

// gdn_gates(a, b [T, H] (one dtype f32/bf16, last dim dense, any row stride), A_log [H], dt_bias [H] (f32/bf16),
// g [T, H] f32, beta [T, H] (b's dtype)): llm.gdn_gates. g = -exp(A_log) * softplus(a + dt_bias) in float32
// (softplus as torch: x > 20 ? x : log1p(exp(x))); beta = sigmoid(b) by at::sigmoid_out, torch's bits.
ENTRY(py_gdn_gates)
  const char* op = "gdn_gates";
  need_args(nargs, 6, op);
  const at::Tensor& a = any_tensor(args[0], op, "a");
  const at::Tensor& b = any_tensor(args[1], op, "b");
  const at::Tensor& alog = tensor(args[2], op, "A_log");
  const at::Tensor& dtb = tensor(args[3], op, "dt_bias");
  const at::Tensor& g = any_tensor(args[4], op, "g");
  const at::Tensor& beta = any_tensor(args[5], op, "beta");
  const int dt = float_dt(a, op, "a"), adt = float_dt(alog, op, "A_log"), bdt = float_dt(dtb, op, "dt_bias");
  need_dtype(b, a.scalar_type(), op, "b");
  need_dtype(beta, a.scalar_type(), op, "beta");
  need_dtype(g, at::kFloat, op, "g");
  NEED(a.dim() == 2 && b.sizes() == a.sizes() && g.sizes() == a.sizes() && beta.sizes() == a.sizes() &&
       alog.dim() == 1 && alog.size(0) == a.size(1) && dtb.sizes() == alog.sizes(), g_shape_error,
       std::string(op) + ": need a, b, g, beta [T, H], A_log and dt_bias [H]; got a " + dims(a) + ", b " + dims(b) +
       ", A_log " + dims(alog) + ", dt_bias " + dims(dtb) + ", g " + dims(g) + ", beta " + dims(beta));
  const int64_t T = a.size(0), H = a.size(1);
  const int64_t lda = row_stride(a, 1, op, "a"), ldg = row_stride(g, 1, op, "g");
  const void *ap = a.data_ptr(), *lp = alog.data_ptr(), *bp = dtb.data_ptr();
  float* gp = g.data_ptr<float>();
  for (int64_t h = 0; h < H; ++h) {
    const float decay = -std::exp(elem(lp, adt, h)), bias = elem(bp, bdt, h);
    for (int64_t t = 0; t < T; ++t) {
      const float x = elem(ap, dt, t * lda + h) + bias;
      gp[t * ldg + h] = (x > 20.f ? x : std::log1p(std::exp(x))) * decay;
    }
  }
  at::Tensor out = beta;  // sigmoid_out takes a mutable reference
  at::sigmoid_out(out, b);
  Py_RETURN_NONE;
EXIT

}  // namespace

// ===== load time: repack =====================================================================================
// GGUF block bytes into the packed rows the kernels read (repack.h), rows split over torch's threads.
#include "repack.h"

namespace {

// repack(src uint8 [N, GGUF row bytes] (rows of one stride, each dense: a view of the file map), dst uint8 [N, packed
// row bytes] contiguous, fmt int (layouts.format_code), K int) -> True, or False when fmt has no native repack
ENTRY(py_repack)
  const char* op = "repack";
  need_args(nargs, 4, op);
  const at::Tensor& src = any_tensor(args[0], op, "src");
  const at::Tensor& dst = tensor(args[1], op, "dst");
  const long fmt = PyLong_AsLong(args[2]), K = PyLong_AsLong(args[3]);
  if (PyErr_Occurred()) throw Fail{};
  need_dtype(src, at::kByte, op, "src");
  need_dtype(dst, at::kByte, op, "dst");
  int64_t block = 0, in_bytes = 0, out_bytes = 0;
  const int x16 = dtn::x16_base(int(fmt));  // the interleaved layout of 16 rows a group: x16_group per group
  if (!dtn::repack::block_bytes(x16 >= 0 ? x16 : int(fmt), &block, &in_bytes, &out_bytes)) Py_RETURN_FALSE;
  NEED(x16 < 0 || (src.dim() == 2 && src.size(0) % 16 == 0 && K % 64 == 0), g_shape_error,
       std::string(op) + ": the interleaved format " + std::to_string(fmt) + " needs N a multiple of 16 and K of "
       "64; got src " + dims(src) + ", K = " + std::to_string(K));
  NEED(src.dim() == 2 && dst.dim() == 2 && src.size(0) == dst.size(0) && K > 0 && K % block == 0 &&
       src.size(1) == K / block * in_bytes && dst.size(1) == K / block * out_bytes, g_shape_error,
       std::string(op) + ": format " + std::to_string(fmt) + " of K = " + std::to_string(K) + " needs src [N, " +
       std::to_string(K / block * in_bytes) + "] and dst [N, " + std::to_string(K / block * out_bytes) +
       "] (K a multiple of " + std::to_string(block) + "); got src " + dims(src) + ", dst " + dims(dst));
  const int64_t ls = row_stride(src, 1, op, "src"), N = src.size(0), in_row = src.size(1), out_row = dst.size(1);
  const uint8_t* sp = src.data_ptr<uint8_t>();
  uint8_t* dp = dst.data_ptr<uint8_t>();
  Py_BEGIN_ALLOW_THREADS
  if (x16 >= 0)
    parallel_rows(N / 16, 16 * in_row * 4, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) dtn::repack::x16_group(x16, sp + 16 * g * ls, ls, dp + 16 * g * out_row, K / 32);
    });
  else
    parallel_rows(N, in_row * 4, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) dtn::repack::row(int(fmt), sp + r * ls, dp + r * out_row, K);
    });
  Py_END_ALLOW_THREADS
  Py_RETURN_TRUE;
EXIT

}  // namespace
