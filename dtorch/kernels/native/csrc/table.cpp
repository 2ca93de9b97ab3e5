// The kernel table of each ISA (table.h), assembled at load from the slots its objects registered (isa_fill.h,
// slots.h) and checked complete against the op list (ops.def): a row no object registered, or registered with
// another signature, names itself and its group.
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "slots.h"
#include "table.h"

namespace dtn {
namespace {

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

Built build(const std::string& isa) {
  Built b{};
  Table& t = b.table;
  std::string* m = &b.missing;
#define DTN_KERNEL(group, op, ret, params)                        \
  if (const Slot* s = find(isa, #op, #group, #ret " " #params, m)) \
    t.op = reinterpret_cast<ret(*) params>(s->fn);
#define DTN_VALUE(group, type, name) \
  if (const Slot* s = find(isa, #name, #group, #type, m)) t.name = *static_cast<const type*>(s->value);
#define DTN_OP(group, name, op, fallback, meta, doc, args)        \
  if (const Slot* s = find(isa, #name, #group, "DTN_OP " #args, m)) \
    t.name = reinterpret_cast<void (*)(const name##_args&, int64_t, int64_t)>(s->fn);
#include "op_rows.h"
  return b;
}

}  // namespace

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
    it = built.emplace(isa, build(isa)).first;
    it->second.table.name = it->first.c_str();
  }
  if (!it->second.missing.empty()) {
    if (missing) *missing = it->second.missing.c_str();
    return nullptr;
  }
  return &it->second.table;
}

}  // namespace dtn
