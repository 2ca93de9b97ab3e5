// Expands the declared op rows (DTN_OP, ops.def) with the DTN_OP macro its includer defined (none: nothing), then
// undefines it and the argument macros: the rows of one group when DTN_GROUP_DEF names its file (an ISA object, built
// by build.py with -DDTN_GROUP_DEF="ops/<group>.def"; a group without declared ops has no such file), else every row
// (ops.def: table.cpp). binding.cpp never includes this: a row reaches it only at run time (table.h's RowInfo). No
// include guard: each include expands the rows again with the macros defined at that point.
#ifndef DTN_OP
#define DTN_OP(group, name, op, fallback, meta, doc, args)
#endif

#ifdef DTN_GROUP
#ifdef DTN_GROUP_DEF
#include DTN_GROUP_DEF
#endif
#else
#include "ops.def"
#endif

#undef DTN_OP
#undef DTN_IN
#undef DTN_HALF
#undef DTN_VEC
#undef DTN_OUT
#undef DTN_F32
#undef DTN_I64
#undef DTN_BOOL
