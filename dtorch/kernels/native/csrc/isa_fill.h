// Included last by each ISA unit (isa_<isa>.cpp), after its kernels and its namespace DTN_ISA::kernels: registers
// this object's group's kernel slots and values (DTN_GROUP_SLOTS, see entries.def) and its declared rows' kernels
// (DTN_GROUP_DEF, see ops.def) by name (slots.h), for table.cpp to assemble the ISA's table. A kernel of the group
// that the unit lacks is a compile error naming it: "'<op>' is not a member of 'isa_<isa>::kernels'"; one of another
// signature than its row, an invalid static_cast naming it.
// DTN_ISA (the namespace) and DTN_ISA_NAME (the ISA's name, a string) are defined by the unit.
#include "slots.h"

#if !defined(DTN_GROUP)
#error "build.py compiles each ISA unit with -DDTN_GROUP=<group> (and -DDTN_GROUP_DEF / -DDTN_GROUP_SLOTS: see ops.def)"
#endif

namespace dtn {
namespace {

// a declared row's kernel behind the type-erased signature binding.cpp calls (table.h's RowFn)
template <class A, void (*F)(const A&, int64_t, int64_t)>
void row_thunk(const void* a, int64_t r0, int64_t r1) {
  F(*static_cast<const A*>(a), r0, r1);
}

bool register_group() {
#define DTN_KERNEL(group, op, ret, params)                                                                    \
  add_slot(DTN_ISA_NAME, #group, #op, #ret " " #params,                                                      \
           reinterpret_cast<AnyFn>(static_cast<ret(*) params>(DTN_ISA::kernels::op)), nullptr);
#define DTN_VALUE(group, type, name)                                \
  {                                                                 \
    static constexpr type value = DTN_ISA::kernels::name;          \
    add_slot(DTN_ISA_NAME, #group, #name, #type, nullptr, &value); \
  }
#include "slot_rows.h"
#define DTN_OP(group, name, op, fallback, meta, doc, args)                                                   \
  add_slot(DTN_ISA_NAME, #group, #name, "DTN_OP " #args,                                                    \
           reinterpret_cast<AnyFn>(&row_thunk<name##_args, static_cast<void (*)(const name##_args&, int64_t,  \
                                                                                   int64_t)>(                 \
                                                               DTN_ISA::kernels::name)>),                    \
           nullptr);
#include "op_rows.h"
  return true;
}

const bool registered = register_group();

}  // namespace
}  // namespace dtn
