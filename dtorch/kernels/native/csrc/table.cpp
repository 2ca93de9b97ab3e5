// The kernel table of each ISA (table.h), assembled at load from the slots its objects registered (isa_fill.h,
// slots.h) and checked complete against the op list (entries.def's slots, ops.def's rows): a slot or row no object
// registered, or registered with another signature, names itself and its group. Also the rows' descriptions
// (RowInfo) that binding.cpp reads at run time. The one unit besides the ISA objects that reads ops.def: small and
// without torch's headers, so a new row recompiles it in a second or two.
#include <cstddef>
#include <iterator>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "op_args.h"
#include "slots.h"
#include "table.h"

namespace dtn {
namespace {

// -- the rows' descriptions: each argument's kind, name and field offsets in the row's struct ----------------------
#define DTN_IN(n) RowArg{ARG_IN, #n, offsetof(S, n), offsetof(S, ld_##n)},
#define DTN_HALF(n) RowArg{ARG_HALF, #n, offsetof(S, n), offsetof(S, ld_##n)},
#define DTN_VEC(n) RowArg{ARG_VEC, #n, offsetof(S, n), 0},
#define DTN_OUT(n) RowArg{ARG_OUT, #n, offsetof(S, n), offsetof(S, ld_##n)},
#define DTN_F32(n) RowArg{ARG_F32, #n, offsetof(S, n), 0},
#define DTN_I64(n) RowArg{ARG_I64, #n, offsetof(S, n), 0},
#define DTN_BOOL(n) RowArg{ARG_BOOL, #n, offsetof(S, n), 0},
namespace row_args {
#define DTN_OP(group, name, op, fallback, meta, doc, args) \
  struct name {                                           \
    using S = name##_args;                                \
    static constexpr RowArg list[] = {args};              \
  };
#include "op_rows.h"
}  // namespace row_args

#define DTN_OP(group, name, op, fallback, meta, doc, args)                                                       \
  RowInfo{#name, #group, doc, #args, sizeof(name##_args), offsetof(name##_args, dt), offsetof(name##_args, R), \
          offsetof(name##_args, D), int(std::size(row_args::name::list)), row_args::name::list},
const RowInfo kRows[] = {
#include "op_rows.h"
    RowInfo{}};  // the end (a list may have no row)
constexpr int kNumRows = int(std::size(kRows)) - 1;

// -- the tables -------------------------------------------------------------------------------------------------
struct Slot {
  std::string isa, group, name, signature;
  AnyFn fn;
  const void* value;
};

std::vector<Slot>& slots() {  // constructed on first use: the objects' static initializers run in any order
  static std::vector<Slot> v;
  return v;
}

struct Built {
  Table table;
  std::vector<RowFn> ops;
  std::string missing;  // empty when complete
};

// the slot of `isa` named `name` with `signature`, or nullptr (then the row is added to *missing)
const Slot* find(const std::string& isa, const char* name, const char* group, const char* signature,
                 std::string* missing) {
  for (const Slot& s : slots())
    if (s.isa == isa && s.name == name) {
      if (s.signature == signature) return &s;
      *missing += std::string(missing->empty() ? "" : ", ") + name + " (group " + group + ": registered as " +
                  s.signature + ", the row says " + signature + ")";
      return nullptr;
    }
  *missing += std::string(missing->empty() ? "" : ", ") + name + " (group " + group + ")";
  return nullptr;
}

void build(const std::string& isa, Built* b) {
  Table& t = b->table;
  std::string* m = &b->missing;
#define DTN_KERNEL(group, op, ret, params)                        \
  if (const Slot* s = find(isa, #op, #group, #ret " " #params, m)) \
    t.op = reinterpret_cast<ret(*) params>(s->fn);
#define DTN_VALUE(group, type, name) \
  if (const Slot* s = find(isa, #name, #group, #type, m)) t.name = *static_cast<const type*>(s->value);
#include "slot_rows.h"
#define DTN_OP(group, name, op, fallback, meta, doc, args)          \
  {                                                                 \
    const Slot* s = find(isa, #name, #group, "DTN_OP " #args, m);   \
    b->ops.push_back(s ? reinterpret_cast<RowFn>(s->fn) : nullptr); \
  }
#include "op_rows.h"
  t.ops = b->ops.data();
}

}  // namespace

const RowInfo* rows(int* n) {
  *n = kNumRows;
  return kRows;
}

bool add_slot(const char* isa, const char* group, const char* name, const char* signature, AnyFn fn,
              const void* value) {
  slots().push_back({isa, group, name, signature, fn, value});
  return true;
}

const Table* table(const char* isa, const char** missing) {
  static std::map<std::string, Built> built;  // called under the GIL (module init, set_isa): no lock
  auto it = built.find(isa);
  if (it == built.end()) {
    bool linked = false;
    for (const Slot& s : slots()) linked |= s.isa == isa;
    if (!linked) return nullptr;
    it = built.emplace(isa, Built{}).first;
    build(isa, &it->second);
    it->second.table.name = it->first.c_str();
  }
  if (!it->second.missing.empty()) {
    if (missing) *missing = it->second.missing.c_str();
    return nullptr;
  }
  return &it->second.table;
}

}  // namespace dtn
