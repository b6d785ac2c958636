// Scalar AdamW: the reference every SIMD variant must equal bit for bit.
// Compiled with no ISA flags (runs on any CPU).
#include <math.h>
#include <string.h>

#include "isa.h"

namespace infinity_native {
namespace {
#include "lane1.inc"
using Vec = Lane1;
#include "adam_kernel.inc"
#include "adam_bf16m.inc"
#include "adam_q8.inc"
}  // namespace

namespace scalar {
void adam_range(float* p, const void* g, float* m, float* v, void* out, int64_t n, int32_t gdt,
                int32_t odt, const AdamConsts& c, bool probe) {
  adam_range_entry(p, g, m, v, out, n, gdt, odt, c, probe);
}
void lowbit_range(float* p, const void* g, void* m, void* v, float* ms, float* vs, void* out, int64_t n,
                  int32_t gdt, int32_t odt, int32_t mdt, const AdamConsts& c, bool probe) {
  lowbit_range_entry(p, g, m, v, ms, vs, out, n, gdt, odt, mdt, c, probe);
}
}  // namespace scalar
}  // namespace infinity_native
