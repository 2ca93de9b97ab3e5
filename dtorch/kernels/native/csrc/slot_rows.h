// Expands the hand-written part of the op list (entries.def) with the DTN_KERNEL / DTN_VALUE / DTN_ENTRY macros its
// includer defined (the others expand to nothing), then undefines them: one group's slots when DTN_GROUP names an ISA
// object's group (DTN_GROUP_SLOTS, its slots/<group>.def, where it has one), else the whole file (table.h's Table,
// binding.cpp's entries). No include guard: each include expands the rows again with the macros defined then.
#ifndef DTN_KERNEL
#define DTN_KERNEL(group, op, ret, params)
#endif
#ifndef DTN_VALUE
#define DTN_VALUE(group, type, name)
#endif
#ifndef DTN_ENTRY
#define DTN_ENTRY(name, ops, doc)
#endif

#ifdef DTN_GROUP
#ifdef DTN_GROUP_SLOTS
#include DTN_GROUP_SLOTS
#endif
#else
#include "entries.def"
#endif

#undef DTN_KERNEL
#undef DTN_VALUE
#undef DTN_ENTRY
