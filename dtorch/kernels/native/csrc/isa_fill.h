// Included last by each ISA unit (isa_<isa>.cpp), after its kernels and its namespace DTN_ISA::kernels: registers a
// function that sets this object's group's fields of the unit's table, by name, from ops.def. build.py compiles the
// unit once per group with -DDTN_GROUP_<group>=1 for that group and =0 for every other, so each object holds and
// fills its own group only. A kernel of the group that the unit lacks is a compile error naming it:
// "'<op>' is not a member of 'isa_<isa>::kernels'".
// DTN_ISA (the namespace) and DTN_ISA_NAME (the ISA's name, a string) are defined by the unit.

#define DTN_CAT_(a, b) a##b
#define DTN_CAT(a, b) DTN_CAT_(a, b)
#define DTN_STR_(a) #a
#define DTN_STR(a) DTN_STR_(a)
#define DTN_SET_0(field)
#define DTN_SET_1(field) t.field = DTN_ISA::kernels::field;

#if !defined(DTN_GROUP)
#error "build.py compiles each ISA unit with -DDTN_GROUP=<group> and -DDTN_GROUP_<group>=1 (see ops.def)"
#endif

namespace dtn {
namespace {

void fill(Table& t) {
  t.name = DTN_ISA_NAME;
#define DTN_KERNEL(group, op, ret, params) DTN_CAT(DTN_SET_, DTN_GROUP_##group)(op)
#define DTN_VALUE(group, type, name) DTN_CAT(DTN_SET_, DTN_GROUP_##group)(name)
#include "ops.def"
}

const bool added = add_fill(DTN_ISA_NAME, DTN_STR(DTN_GROUP), fill);

}  // namespace
}  // namespace dtn
