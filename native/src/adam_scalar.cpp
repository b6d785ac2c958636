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
#include "adam_bf16p.inc"
#include "sumsq_kernel.inc"
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
void bf16p_range(uint16_t* p, const void* g, void* m, void* v, float* ms, float* vs, int64_t n, int32_t gdt,
                 int32_t mdt, const AdamConsts& c, uint64_t k_step, uint64_t index0) {
  bf16p_range_entry(p, g, m, v, ms, vs, n, gdt, mdt, c, k_step, index0);
}
double sumsq_block(const void* x, int64_t n, int32_t dt) { return sumsq_block_entry(x, n, dt); }
}  // namespace scalar
}  // namespace infinity_native
