// The kernel table of each ISA, assembled at load from the groups its objects registered (isa_fill.h) and checked
// complete against the op list (ops.def): a field no object filled names itself and its group.
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "common.h"

namespace dtn {
namespace {

struct Fill {
  std::string isa, group;
  void (*fill)(Table&);
};

std::vector<Fill>& fills() {  // constructed on first use: the objects' static initializers run in any order
  static std::vector<Fill> v;
  return v;
}

struct Built {
  Table table;
  std::string missing;  // empty when complete
};

// the groups each field of ops.def belongs to, to name them in the message about a missing field
std::string missing_fields(const Table& t) {
  std::string m;
  auto add = [&](bool set, const char* field, const char* group) {
    if (!set) m += std::string(m.empty() ? "" : ", ") + field + " (group " + group + ")";
  };
#define DTN_KERNEL(group, op, ret, params) add(t.op != nullptr, #op, #group);
#include "ops.def"
  return m;
}

Built build(const std::string& isa) {
  Built b{};
  for (const Fill& f : fills())
    if (f.isa == isa) f.fill(b.table);
  b.missing = missing_fields(b.table);
  return b;
}

}  // namespace

bool add_fill(const char* isa, const char* group, void (*fill)(Table&)) {
  fills().push_back({isa, group, fill});
  return true;
}

const Table* table(const char* isa, const char** missing) {
  static std::map<std::string, Built> built;  // called under the GIL (module init, set_isa): no lock
  auto it = built.find(isa);
  if (it == built.end()) {
    bool linked = false;
    for (const Fill& f : fills()) linked |= f.isa == isa;
    if (!linked) return nullptr;
    it = built.emplace(isa, build(isa)).first;
  }
  if (!it->second.missing.empty()) {
    if (missing) *missing = it->second.missing.c_str();
    return nullptr;
  }
  return &it->second.table;
}

}  // namespace dtn
