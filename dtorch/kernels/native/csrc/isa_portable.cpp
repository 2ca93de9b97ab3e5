// The portable kernels: plain C++ for any CPU, built without -m flags. build.py compiles this unit once per group of
// ops.def (-DDTN_GROUP_<group>=1): each object includes the headers its group needs (a group's kernels call into
// the headers above them in this list) and fills that group's fields of the table (isa_fill.h).
// Everything here lives in its own namespace, so no inline function is shared with a unit built for another ISA.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"

#define DTN_ISA isa_portable
#define DTN_ISA_NAME "portable"
namespace DTN_ISA {
#include "generic.h"
#include "isa_groups.h"
}  // namespace DTN_ISA

// the kernels of this unit by their names in ops.def, where the functions are named otherwise
namespace DTN_ISA::kernels {
using namespace DTN_ISA;
#if DTN_GROUP_quant
constexpr auto qgemm = qgemm_portable;
constexpr auto qgemm_sg = qgemm_sg_portable;
constexpr auto gemv = gemv_portable;
constexpr bool int_prefill = false;
#endif
}  // namespace DTN_ISA::kernels

#include "isa_fill.h"
