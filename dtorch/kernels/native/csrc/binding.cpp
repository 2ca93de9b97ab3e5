// The Python module _dtorch_native: argument checks, workspace, threads (torch's intra-op pool through
// at::parallel_for, split over output rows) and the ISA choice; the kernels live in the isa_*.cpp units.
// Functions take torch tensors (METH_FASTCALL, no copies) and raise the dtorch errors registered by set_errors.
#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mm.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdio>
#include <string>
#include <vector>

#include "common.h"

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

const dtn::Table* table_for(const std::string& isa) {
#if defined(__x86_64__)
  if (isa == "avx512") return dtn::table_avx512();
  if (isa == "avx2") return dtn::table_avx2();
#endif
  if (isa == "portable") return dtn::table_portable();
  return nullptr;
}

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

void need(bool ok, PyObject* type, const std::string& msg) {
  if (!ok) fail(type, msg);
}

void need_dtype(const at::Tensor& t, at::ScalarType st, const char* op, const char* name) {
  if (t.scalar_type() != st)
    fail(g_dtype_error, std::string(op) + ": " + name + " must be " + c10::toString(st) + ", got " + dtype_name(t));
}

void need_args(Py_ssize_t n, Py_ssize_t want, const char* op) {
  if (n != want) fail(g_arg_error, std::string(op) + ": expected " + std::to_string(want) + " arguments, got " +
                                       std::to_string(n));
}

template <class F>
void parallel_rows(int64_t n, int64_t work_per_row, F&& f) {  // chunks of at least ~32k multiply-adds
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, work_per_row));
  if (n <= grain) return f(0, n);
  at::parallel_for(0, n, grain, f);
}

// per-thread activation workspace (QAct arrays); grows, never shrinks
struct Workspace {
  std::vector<int8_t> q;
  std::vector<float> darep, asum;
};
thread_local Workspace t_ws;

// bytes of the qs and d sections of a packed row (dtorch/kernels/layouts.py), and the block size, per format
struct Sizes { int64_t qs, d, aux, block; };
Sizes sizes(int fmt, int64_t K) {
  switch (fmt) {
    case dtn::Q8_0: return {K, K / 16, 0, 32};
    case dtn::Q4_0: return {K / 2, K / 16, 0, 32};
    case dtn::Q4_1: return {K / 2, K / 8, 0, 32};
    case dtn::Q4_K: return {K / 2, K / 64, K / 16, 256};
    case dtn::Q6_K: return {K / 2 + K / 4, K / 128, K / 16, 256};
  }
  fail(g_arg_error, "qlinear: unknown format code " + std::to_string(fmt));
}

// Element k of the K inputs that position i of a dequantized row holds (Table::dequant): the packed order
std::vector<int64_t> kernel_order(int64_t block, int64_t K) {
  std::vector<int64_t> k(size_t(K), 0);
  if (block == 32) {  // super-group g of S blocks: [v 0..7][block j][4] holds element 32 (16 g + j) + 4 v + t
    for (int64_t g = 0, nb = K / 32; g * 16 < nb; ++g) {
      const int64_t S = std::min<int64_t>(16, nb - g * 16);
      for (int64_t v = 0; v < 8; ++v)
        for (int64_t j = 0; j < S; ++j)
          for (int64_t t = 0; t < 4; ++t) k[size_t(g * 512 + v * 4 * S + 4 * j + t)] = (16 * g + j) * 32 + 4 * v + t;
    }
  } else {  // group g of 128: half h, byte i holds element 128 g + 32 (i / 16) + 16 h + i % 16
    for (int64_t i = 0; i < K; ++i) k[size_t(i)] = i / 128 * 128 + (i % 64) / 16 * 32 + (i % 128) / 64 * 16 + i % 16;
  }
  return k;
}

// From this many rows of x on, qlinear dequantizes panels of the weight to float32 and multiplies with torch's GEMM
// (exact float products; the integer kernels' work grows with the rows, the dequantization does not)
constexpr int64_t kFloatRows = 16;

// y [M, N] = x [M, K] @ dequant(w).T (+ bias) through panels of kPanel bytes of float32 weights (they stay in L2)
void qlinear_float(const dtn::Table* tb, const dtn::QWeight& qw, int64_t block, const at::Tensor& x,
                   const at::Tensor* bias, const at::Tensor& out, int64_t M, int64_t N, int64_t K) {
  constexpr int64_t kPanel = 512 << 10;
  const int64_t rows = std::max<int64_t>(16, kPanel / (4 * K) / 16 * 16);
  // x in the packed order and the weight panel live in a per-thread workspace: fresh pages each call cost more
  // than small products
  thread_local std::vector<float> t_xk, t_panel;
  if (int64_t(t_xk.size()) < M * K) t_xk.resize(size_t(M * K));
  if (int64_t(t_panel.size()) < rows * K) t_panel.resize(size_t(rows * K));
  const std::vector<int64_t> order = kernel_order(block, K);
  const at::Tensor x2 = x.reshape({M, K}).to(at::kFloat);
  const at::Tensor xk = at::from_blob(t_xk.data(), {M, K}, x2.options().dtype(at::kFloat));
  at::index_select_out(const_cast<at::Tensor&>(xk), x2, 1,
                       at::from_blob(const_cast<int64_t*>(order.data()), {K}, at::kLong));
  const bool direct = out.scalar_type() == at::kFloat;
  const at::Tensor y = direct ? out.view({M, N}) : at::empty({M, N}, xk.options());
  const at::Tensor b32 = bias ? bias->to(at::kFloat) : at::Tensor();
  float* pp = t_panel.data();
  const at::Tensor panel = at::from_blob(pp, {std::min(rows, N), K}, xk.options());
  for (int64_t n0 = 0; n0 < N; n0 += rows) {
    const int64_t nc = std::min(rows, N - n0);
    parallel_rows(nc, 4 * K, [&](int64_t r0, int64_t r1) { tb->dequant(qw, n0 + r0, n0 + r1, pp + r0 * K); });
    at::Tensor yv = y.narrow(1, n0, nc);
    const at::Tensor wt = panel.narrow(0, 0, nc).t();
    if (bias) at::addmm_out(yv, b32.narrow(0, n0, nc), xk, wt);
    else at::mm_out(yv, xk, wt);
  }
  if (!direct) out.view({M, N}).copy_(y);
}

#define ENTRY(name) PyObject* name(PyObject*, PyObject* const* args, Py_ssize_t nargs) { try {
#define EXIT } catch (const Fail&) { return nullptr; } catch (const std::exception& e) { \
    PyErr_SetString(PyExc_RuntimeError, e.what()); return nullptr; } }

// qlinear(x [..., K] f32/bf16, packed uint8 [N, row bytes], fmt int, bias [N] | None, out [..., N])
ENTRY(py_qlinear)
  need_args(nargs, 5, "qlinear");
  const at::Tensor& x = tensor(args[0], "qlinear", "x");
  const at::Tensor& w = tensor(args[1], "qlinear", "packed");
  const long fmt = PyLong_AsLong(args[2]);
  if (fmt == -1 && PyErr_Occurred()) throw Fail{};
  const bool has_bias = args[3] != Py_None;
  const at::Tensor* bias = has_bias ? &tensor(args[3], "qlinear", "bias") : nullptr;
  const at::Tensor& out = tensor(args[4], "qlinear", "out");
  const int xdt = float_dt(x, "qlinear", "x");
  need(out.scalar_type() == x.scalar_type(), g_dtype_error,
       std::string("qlinear: out must have x's dtype ") + dtype_name(x) + ", got " + dtype_name(out));
  need_dtype(w, at::kByte, "qlinear", "packed");
  need(x.dim() >= 1 && w.dim() == 2, g_shape_error,
       "qlinear: x must be [..., K] and packed [N, row bytes]; got x " + dims(x) + ", packed " + dims(w));
  const int64_t K = x.size(-1), N = w.size(0), M = K ? x.numel() / K : 0;
  const Sizes sz = sizes(int(fmt), K);
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
  const uint8_t* base = w.data_ptr<uint8_t>();
  const dtn::QWeight qw{int(fmt), K, base, rb, reinterpret_cast<const uint16_t*>(base + sz.qs), rb / 2,
                        base + sz.qs + sz.d, rb};
  const void* bp = has_bias ? bias->data_ptr() : nullptr;
  const void* xp = x.data_ptr();
  void* yp = out.data_ptr();
  if (M >= kFloatRows) {
    std::string err;  // an ATen error must not unwind past the GIL release
    Py_BEGIN_ALLOW_THREADS
    try {
      qlinear_float(tb, qw, sz.block, x, bias, out, M, N, K);
    } catch (const std::exception& e) {
      err = e.what();
    }
    Py_END_ALLOW_THREADS
    need(err.empty(), PyExc_RuntimeError, "qlinear: " + err);
    Py_RETURN_NONE;
  }
  Workspace& ws = t_ws;
  if (sz.block == 32) {  // Q8_0 / Q4_0 / Q4_1: super-groups of 16 blocks
    const int64_t nsg = (K / 32 + 15) / 16;
    if (int64_t(ws.q.size()) < M * nsg * 1024) ws.q.resize(size_t(M * nsg * 1024));
    if (int64_t(ws.darep.size()) < M * nsg * 16) ws.darep.resize(size_t(M * nsg * 16));
    if (int64_t(ws.asum.size()) < M * nsg * 16) ws.asum.resize(size_t(M * nsg * 16));
    const dtn::SGAct a{ws.q.data(), ws.darep.data(), ws.asum.data(), nsg};
    Py_BEGIN_ALLOW_THREADS
    parallel_rows(M, 4 * K, [&](int64_t r0, int64_t r1) {
      tb->quantize_sg(xp, xdt, K, r0, r1, K, ws.q.data(), ws.darep.data(), ws.asum.data());
    });
    parallel_rows(N, M * K, [&](int64_t n0, int64_t n1) { tb->qgemm_sg(qw, a, M, n0, n1, bp, yp, xdt, N); });
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
  parallel_rows(N, M * K, [&](int64_t n0, int64_t n1) { tb->qgemm(qw, a, M, n0, n1, bp, yp, xdt, N); });
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
EXIT

// gemv(x [..., K] f32/bf16, w [N, K] f32/bf16, out [..., N] with x's dtype)
ENTRY(py_gemv)
  need_args(nargs, 3, "gemv");
  const at::Tensor& x = tensor(args[0], "gemv", "x");
  const at::Tensor& w = tensor(args[1], "gemv", "w");
  const at::Tensor& out = tensor(args[2], "gemv", "out");
  const int xdt = float_dt(x, "gemv", "x"), wdt = float_dt(w, "gemv", "w");
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
  parallel_rows(N, M * K, [&](int64_t n0, int64_t n1) { tb->gemv(xp, xdt, M, wp, wdt, K, n0, n1, yp, xdt, N); });
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
EXIT

// rms_norm(x [..., D], res [..., D] | None, res_out | None, w [D], out [..., D], eps float); one dtype for all
ENTRY(py_rms_norm)
  need_args(nargs, 6, "rms_norm");
  const at::Tensor& x = tensor(args[0], "rms_norm", "x");
  const bool has_res = args[1] != Py_None;
  const at::Tensor* res = has_res ? &tensor(args[1], "rms_norm", "residual") : nullptr;
  const at::Tensor* res_out = has_res ? &tensor(args[2], "rms_norm", "residual_out") : nullptr;
  const at::Tensor& w = tensor(args[3], "rms_norm", "weight");
  const at::Tensor& out = tensor(args[4], "rms_norm", "out");
  const double eps = PyFloat_AsDouble(args[5]);
  if (eps == -1.0 && PyErr_Occurred()) throw Fail{};
  const int dt = float_dt(x, "rms_norm", "x");
  const int64_t D = x.dim() ? x.size(-1) : 0, R = D ? x.numel() / D : 0;
  for (const at::Tensor* t : {res, res_out, &w, &out}) {
    if (!t) continue;
    need(t->scalar_type() == x.scalar_type(), g_dtype_error, std::string("rms_norm: every tensor must have x's "
         "dtype ") + dtype_name(x) + ", got " + dtype_name(*t));
    need(t == &w ? (t->dim() == 1 && t->size(0) == D) : t->sizes() == x.sizes(), g_shape_error,
         "rms_norm: x " + dims(x) + " needs weight [" + std::to_string(D) + "] and residual/out like x; got " +
         dims(*t));
  }
  const dtn::Table* tb = g_table;
  const void *xp = x.data_ptr(), *rp = has_res ? res->data_ptr() : nullptr, *wp = w.data_ptr();
  void *rop = has_res ? res_out->data_ptr() : nullptr, *op = out.data_ptr();
  const float e = float(eps);
  Py_BEGIN_ALLOW_THREADS
  parallel_rows(R, 4 * D, [&](int64_t r0, int64_t r1) { tb->rms_norm(xp, rp, rop, wp, op, dt, r0, r1, D, e); });
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
EXIT

// rope(x [..., H, D], cos [..., rot/2] f32, sin like cos, out like x, rot int, interleaved bool); x, out, cos and
// sin may be row-strided views (dense within a row)
ENTRY(py_rope)
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
  const dtn::Table* tb = g_table;
  const void* xp = x.data_ptr();
  void* op = out.data_ptr();
  const float *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
  Py_BEGIN_ALLOW_THREADS
  parallel_rows(R, 4 * H * rot, [&](int64_t r0, int64_t r1) {
    tb->rope(xp, ldx, op, ldo, dt, cp, sp, ldc, P, r0, r1, H, D, rot, interleaved);
  });
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
EXIT

// silu_and_mul(gate, up | None, out): gate [..., 2I] fused (up None) or gate and up [..., I] (row-strided views,
// e.g. the halves of a gate_up output); out [..., I] contiguous
ENTRY(py_silu_and_mul)
  need_args(nargs, 3, "silu_and_mul");
  const at::Tensor& g = any_tensor(args[0], "silu_and_mul", "gate");
  const bool fused = args[1] == Py_None;
  const at::Tensor& u = fused ? g : any_tensor(args[1], "silu_and_mul", "up");
  const at::Tensor& out = tensor(args[2], "silu_and_mul", "out");
  const int dt = float_dt(g, "silu_and_mul", "gate");
  need(out.scalar_type() == g.scalar_type() && u.scalar_type() == g.scalar_type(), g_dtype_error,
       std::string("silu_and_mul: up and out must have gate's dtype ") + dtype_name(g));
  need(g.dim() >= 1 && out.dim() >= 1, g_shape_error, "silu_and_mul: gate and out must be [..., I]");
  const int64_t I = out.size(-1), R = I ? out.numel() / I : 0;
  need(fused ? (g.size(-1) == 2 * I && g.numel() == 2 * R * I) : (g.sizes() == out.sizes() && u.sizes() == out.sizes()),
       g_shape_error, std::string("silu_and_mul: ") + (fused ? "x must be [..., 2I] for out [..., I]" :
       "gate, up and out must have one shape") + "; got gate " + dims(g) + ", out " + dims(out));
  const dtn::Table* tb = g_table;
  const int64_t esz = dt == dtn::F32 ? 4 : 2;
  const int64_t ldg = row_stride(g, 1, "silu_and_mul", "gate"), ldu = fused ? ldg : row_stride(u, 1, "silu_and_mul", "up");
  const char* gp = static_cast<const char*>(g.data_ptr());
  const void* up = fused ? gp + I * esz : u.data_ptr();
  void* op = out.data_ptr();
  Py_BEGIN_ALLOW_THREADS
  parallel_rows(R, 8 * I, [&](int64_t r0, int64_t r1) { tb->silu_and_mul(gp, up, ldg, ldu, op, dt, r0, r1, I); });
  Py_END_ALLOW_THREADS
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

// defined in the KV cache and embedding section at the end of this file
PyObject* py_paged_attention(PyObject*, PyObject* const*, Py_ssize_t);
PyObject* py_cache_store(PyObject*, PyObject* const*, Py_ssize_t);
PyObject* py_qembedding(PyObject*, PyObject* const*, Py_ssize_t);

PyMethodDef methods[] = {
    {"qlinear", (PyCFunction)(void (*)())py_qlinear, METH_FASTCALL, "y = x @ dequant(w).T into out"},
    {"gemv", (PyCFunction)(void (*)())py_gemv, METH_FASTCALL, "y = x @ w.T into out (float32/bf16 w)"},
    {"rms_norm", (PyCFunction)(void (*)())py_rms_norm, METH_FASTCALL, "(residual add and) RMSNorm into out"},
    {"rope", (PyCFunction)(void (*)())py_rope, METH_FASTCALL, "rotary embedding into out"},
    {"silu_and_mul", (PyCFunction)(void (*)())py_silu_and_mul, METH_FASTCALL, "silu(gate) * up into out"},
    {"set_isa", (PyCFunction)(void (*)())py_set_isa, METH_FASTCALL, "choose the kernel table"},
    {"isa", (PyCFunction)(void (*)())py_isa, METH_FASTCALL, "the kernel table in use"},
    {"cpu_supports", (PyCFunction)(void (*)())py_cpu_supports, METH_FASTCALL, "whether this CPU runs an ISA"},
    {"set_errors", (PyCFunction)(void (*)())py_set_errors, METH_FASTCALL, "the dtorch error classes to raise"},
    {"paged_attention", (PyCFunction)(void (*)())py_paged_attention, METH_FASTCALL, "attention over paged KV caches"},
    {"cache_store", (PyCFunction)(void (*)())py_cache_store, METH_FASTCALL, "key/value rows into cache slots"},
    {"qembedding", (PyCFunction)(void (*)())py_qembedding, METH_FASTCALL, "dequantized rows of a gguf weight"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dtorch_native", "dtorch native CPU kernels", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__dtorch_native() {
  g_table = cpu_has("avx512") && table_for("avx512") ? table_for("avx512")
          : cpu_has("avx2") && table_for("avx2")     ? table_for("avx2")
                                                     : dtn::table_portable();
  return PyModule_Create(&module);
}

// ===== KV cache and quantized embedding: paged_attention, cache_store, qembedding ===========================
// llm.flash_attention_with_kvcache runs in the ISA units (attention.h, their AttnTable); storing a step's keys and
// gathering embedding rows are copies and a dequantization of a few rows, plain C++ here.
namespace {

// need() that builds its message only when the check fails (these run on every decode step)
#define NEED(ok, type, msg) \
  do {                      \
    if (!(ok)) fail(type, msg); \
  } while (0)

const dtn::AttnTable* attn_table() {  // the AttnTable of the ISA g_table belongs to
  static const dtn::Table* seen = nullptr;
  static const dtn::AttnTable* at = nullptr;
  if (g_table != seen) {
    const std::string name = g_table->name;
#if defined(__x86_64__)
    at = name == "avx512" ? dtn::attn_table_avx512() : name == "avx2" ? dtn::attn_table_avx2()
                                                                        : dtn::attn_table_portable();
#else
    at = dtn::attn_table_portable();
#endif
    seen = g_table;
  }
  return at;
}

// the row stride of a [T, H, D] view whose last dim is dense; its head stride goes to *head
int64_t token_stride(const at::Tensor& t, int64_t* head, const char* op, const char* name) {
  NEED(t.dim() == 3 && (t.stride(2) == 1 || t.size(2) == 1), g_layout_error,
       std::string(op) + ": " + name + " " + dims(t) + " must be [T, H, D] with D dense");
  *head = t.stride(1);
  return t.stride(0);
}

thread_local std::vector<dtn::AttnItem> t_items;

// paged_attention(q [T, H, D], k_cache, v_cache [blocks, block_size, Hkv, D], cu_seqlens_q int32 [N + 1],
// seqlens_k int32 [N], block_table int32 [N, max_blocks], out [T, H, D], causal bool, scale float); q and out
// may be token/head-strided views (D dense); D a multiple of 16 up to 256
ENTRY(py_paged_attention)
  const char* op = "paged_attention";
  need_args(nargs, 9, op);
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
  const int dt = float_dt(q, op, "q");
  for (const at::Tensor* t : {&kc, &vc, &out})
    NEED(t->scalar_type() == q.scalar_type(), g_dtype_error, std::string(op) + ": caches and out must have q's "
         "dtype " + dtype_name(q) + ", got " + dtype_name(*t));
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
    for (int64_t b = 0; b < used; ++b)
      NEED(tp[s * mb + b] >= 0 && tp[s * mb + b] < nblocks, g_arg_error, std::string(op) + ": block_table[" +
           std::to_string(s) + ", " + std::to_string(b) + "] = " + std::to_string(tp[s * mb + b]) +
           " is outside 0.." + std::to_string(nblocks - 1));
    const int64_t rows = nq * G;
    for (int64_t h = 0; h < hkv; ++h)
      for (int64_t r0 = 0; r0 < rows; r0 += 16)
        items.push_back({int32_t(s), int32_t(h), int32_t(r0), int32_t(std::min<int64_t>(rows, r0 + 16))});
    work += double(rows) * double(hkv) * double(n) * double(D);
  }
  const dtn::AttnCall c{q.data_ptr(), q_tok, q_head, kc.data_ptr(), vc.data_ptr(), bs, hkv, out.data_ptr(), o_tok,
                        o_head, cp, lp, tp, mb, dt, D, G, float(scale), causal};
  const dtn::AttnTable* at = attn_table();
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

// cache_store(key, value [T, Hkv, D], k_cache, v_cache [blocks, block_size, Hkv, D], slots int32/int64 [T]):
// row t to flat cache row slots[t]; a negative slot is skipped. key/value rows may be strided (heads dense).
ENTRY(py_cache_store)
  const char* op = "cache_store";
  need_args(nargs, 5, op);
  const at::Tensor& k = any_tensor(args[0], op, "key");
  const at::Tensor& v = any_tensor(args[1], op, "value");
  const at::Tensor& kc = tensor(args[2], op, "k_cache");
  const at::Tensor& vc = tensor(args[3], op, "v_cache");
  const at::Tensor& slots = tensor(args[4], op, "slot_mapping");
  for (const at::Tensor* t : {&v, &kc, &vc})
    NEED(t->scalar_type() == k.scalar_type(), g_dtype_error, std::string(op) + ": value and the caches must have "
         "key's dtype " + dtype_name(k) + ", got " + dtype_name(*t));
  NEED(slots.scalar_type() == at::kLong || slots.scalar_type() == at::kInt, g_dtype_error,
       std::string(op) + ": slot_mapping must be int64 or int32, got " + dtype_name(slots));
  NEED(k.dim() == 3 && v.sizes() == k.sizes() && kc.dim() == 4 && vc.sizes() == kc.sizes() &&
       k.size(1) == kc.size(2) && k.size(2) == kc.size(3) && slots.dim() == 1 && slots.size(0) == k.size(0),
       g_shape_error, std::string(op) + ": need key/value [T, Hkv, D], caches [blocks, block_size, Hkv, D] and "
       "slot_mapping [T]; got " + dims(k) + ", " + dims(kc) + ", " + dims(slots));
  const int64_t T = k.size(0), rows = kc.size(0) * kc.size(1);
  const int64_t ldk = row_stride(k, 2, op, "key"), ldv = row_stride(v, 2, op, "value");
  const int64_t esz = k.element_size(), width = k.size(1) * k.size(2);
  const char *kp = static_cast<const char*>(k.data_ptr()), *vp = static_cast<const char*>(v.data_ptr());
  char *kcp = static_cast<char*>(kc.data_ptr()), *vcp = static_cast<char*>(vc.data_ptr());
  const bool wide = slots.scalar_type() == at::kLong;
  const void* sp = slots.data_ptr();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = wide ? static_cast<const int64_t*>(sp)[t] : static_cast<const int32_t*>(sp)[t];
    if (s < 0) continue;
    NEED(s < rows, g_arg_error, std::string(op) + ": slot " + std::to_string(s) + " is past the cache's " +
         std::to_string(rows) + " rows");
    std::memcpy(kcp + s * width * esz, kp + t * ldk * esz, size_t(width * esz));
    std::memcpy(vcp + s * width * esz, vp + t * ldv * esz, size_t(width * esz));
  }
  Py_RETURN_NONE;
EXIT

// one row of a Q8_0 / Q4_0 / Q4_1 weight packed as dtorch/kernels/layouts.py says (super-groups of 16 blocks of
// 32: S fp16 d, then S fp16 m for Q4_1, then the quants as [step u][block j][4 bytes]) -> E floats, computed as
// layouts.dequantize does (d * q, d * (q - 8), d * q + m: the same float32 operations, so the same bits)
void dequant_row(int fmt, const uint8_t* row, int64_t E, float* x) {
  const int64_t nb = E / 32, head = fmt == dtn::Q4_1 ? 4 : 2, qb = fmt == dtn::Q8_0 ? 32 : 16, ts = head + qb;
  auto half = [](const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return c10::detail::fp16_ieee_to_fp32_value(h); };
  for (int64_t g0 = 0; g0 < nb; g0 += 16) {
    const int64_t S = std::min<int64_t>(16, nb - g0);
    const uint8_t* sg = row + g0 * ts;
    const uint8_t* qs = sg + head * S;
    for (int64_t j = 0; j < S; ++j) {
      const float d = half(sg + 2 * j), m = fmt == dtn::Q4_1 ? half(sg + 2 * S + 2 * j) : 0.f;
      float* xb = x + (g0 + j) * 32;
      for (int64_t b = 0; b < qb; ++b) {
        const uint8_t byte = qs[(b / 4) * S * 4 + j * 4 + b % 4];
        if (fmt == dtn::Q8_0) {
          xb[b] = float(int8_t(byte ^ 0x80)) * d;
        } else if (fmt == dtn::Q4_0) {
          xb[b] = d * float(int(byte & 15) - 8);
          xb[b + 16] = d * float(int(byte >> 4) - 8);
        } else {
          xb[b] = d * float(byte & 15) + m;
          xb[b + 16] = d * float(byte >> 4) + m;
        }
      }
    }
  }
}

// qembedding(w uint8 [V, row bytes] (Q8_0 / Q4_0 / Q4_1), ids int32/int64 [...], fmt int, vocab_start int | None,
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
  NEED(fmt == dtn::Q8_0 || fmt == dtn::Q4_0 || fmt == dtn::Q4_1, g_layout_error,
       std::string(op) + ": format " + std::to_string(fmt) + " is not Q8_0, Q4_0 or Q4_1");
  const int64_t E = out.dim() ? out.size(-1) : 0, V = w.dim() == 2 ? w.size(0) : 0, M = ids.numel();
  const int64_t rb = E / 32 * (fmt == dtn::Q8_0 ? 34 : fmt == dtn::Q4_0 ? 18 : 20);
  NEED(w.dim() == 2 && E > 0 && E % 32 == 0 && w.size(1) == rb && out.numel() == M * E, g_shape_error,
       std::string(op) + ": need w [V, row bytes of E], out [..., E] with E a multiple of 32 and one row per id; "
       "got w " + dims(w) + ", ids " + dims(ids) + ", out " + dims(out));
  const bool wide = ids.scalar_type() == at::kLong;
  const void* idp = ids.data_ptr();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  std::vector<float> buf(dt == dtn::F32 ? 0 : size_t(E));
  for (int64_t t = 0; t < M; ++t) {
    const int64_t r = (wide ? static_cast<const int64_t*>(idp)[t] : static_cast<const int32_t*>(idp)[t]) - start;
    NEED(sharded || (r >= 0 && r < V), g_arg_error, std::string(op) + ": id " + std::to_string(r) +
         " is outside the vocabulary of " + std::to_string(V));
    float* x = dt == dtn::F32 ? out.data_ptr<float>() + t * E : buf.data();
    if (r >= 0 && r < V) dequant_row(int(fmt), wp + r * rb, E, x);
    else std::fill(x, x + E, 0.f);
    if (dt == dtn::BF16) {
      c10::BFloat16* o = out.data_ptr<c10::BFloat16>() + t * E;
      for (int64_t e = 0; e < E; ++e) o[e] = c10::BFloat16(x[e]);
    }
  }
  Py_RETURN_NONE;
EXIT

}  // namespace
