// The Python module _dtorch_native: argument checks, workspace, threads (torch's intra-op pool through
// at::parallel_for, split over output rows) and the ISA choice; the kernels live in the isa_*.cpp units.
// Functions take torch tensors (METH_FASTCALL, no copies) and raise the dtorch errors registered by set_errors.
#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
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
  Workspace& ws = t_ws;
  if (sz.block == 32) {  // Q8_0 / Q4_0 / Q4_1: super-groups of 16 blocks
    const int64_t nsg = (K / 32 + 15) / 16;
    if (int64_t(ws.q.size()) < M * nsg * 512) ws.q.resize(size_t(M * nsg * 512));
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
  if (int64_t(ws.q.size()) < M * ng * 128) ws.q.resize(size_t(M * ng * 128));
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
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dtorch_native", "dtorch native CPU kernels", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__dtorch_native() {
  g_table = cpu_has("avx512") && table_for("avx512") ? table_for("avx512")
          : cpu_has("avx2") && table_for("avx2")     ? table_for("avx2")
                                                     : dtn::table_portable();
  return PyModule_Create(&module);
}
