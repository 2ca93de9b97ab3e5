// The headers of the groups that every ISA unit builds alike, included inside the unit's namespace after its own
// quant headers: a group's kernels call into the headers above them in this list.
#if DTN_GROUP_elementwise || DTN_GROUP_attention || DTN_GROUP_recurrent
#include "elementwise.h"
#endif
#if DTN_GROUP_attention || DTN_GROUP_recurrent
#include "attention.h"  // V16, which recurrent.h uses too
#endif
#if DTN_GROUP_recurrent
#include "recurrent.h"
#endif
