// Expands op rows with the DTN_* row macros its includer defined (the others expand to nothing), then undefines
// every row and argument macro: the rows of one group when DTN_GROUP_DEF names its file (an ISA object, built by
// build.py with -DDTN_GROUP_DEF="ops/<group>.def"), else every row (ops.def). No include guard: each include expands
// the rows again with the macros defined at that point.
#ifndef DTN_OP
#define DTN_OP(group, name, op, fallback, meta, doc, args)
#endif
#ifndef DTN_KERNEL
#define DTN_KERNEL(group, op, ret, params)
#endif
#ifndef DTN_VALUE
#define DTN_VALUE(group, type, name)
#endif
#ifndef DTN_ENTRY
#define DTN_ENTRY(name, ops, doc)
#endif

#ifdef DTN_GROUP_DEF
#include DTN_GROUP_DEF
#else
#include "ops.def"
#endif

#undef DTN_OP
#undef DTN_KERNEL
#undef DTN_VALUE
#undef DTN_ENTRY
#undef DTN_IN
#undef DTN_VEC
#undef DTN_OUT
#undef DTN_F32
#undef DTN_I64
#undef DTN_BOOL
