// Internal declarations shared by the dispatcher and the per-ISA kernels.
#pragma once
#include <stdint.h>
#include "infinity_native.h"

// ISA levels the CPU and OS support (bit i = level i). Never fails.
uint32_t inf_cpu_isa_mask();

namespace infinity_native {

// Per-call constants, derived once from inf_adam_hparams (see adam.cpp).
struct AdamConsts {
  float lr_decay;       // AdamW: 1 - lr*wd (params scaled first); Adam: 1
  float l2;             // Adam: wd added to the gradient as wd*param; AdamW: 0
  float one_minus_b1;   // lerp weight of exp_avg
  float beta2;
  float one_minus_b2;
  float neg_step_size;  // -lr / bias_correction1
  float bc2_sqrt;       // sqrt(bias_correction2)
  float eps;
  float grad_scale;
  bool adamw;           // decoupled weight decay
};

// The constants of one call's hyper-parameters (adam.cpp).
AdamConsts adam_consts(const inf_adam_hparams& hp);

// Below this many elements per thread, waking another thread costs more than
// it saves (~10 us of work at memory speed).
constexpr int64_t kMinElemsPerThread = 1 << 15;
// Thread chunks start at multiples of this many elements (one 64-byte line
// of fp32 and of bf16), so threads never share a cache line of a buffer.
constexpr int64_t kChunkAlign = 64;

// Updates elements [0, n) of one tensor. g and out are typed by the dtypes.
// probe=true replaces the maths by trivial adds with the same memory traffic.
using RangeFn = void (*)(float* p, const void* g, float* m, float* v, void* out, int64_t n,
                         int32_t grad_dtype, int32_t out_dtype, const AdamConsts& c, bool probe);

// The same over bf16 (mdt = INF_DT_BF16) or 8-bit (INF_DT_I8) moments m, v; for
// 8-bit, [0, n) starts at a block boundary and ms, vs are its blocks' scales.
using LowbitRangeFn = void (*)(float* p, const void* g, void* m, void* v, float* ms, float* vs, void* out,
                               int64_t n, int32_t grad_dtype, int32_t out_dtype, int32_t moment_dtype,
                               const AdamConsts& c, bool probe);
#define INF_LOWBIT_DECL void lowbit_range(float*, const void*, void*, void*, float*, float*, void*, int64_t, \
                                          int32_t, int32_t, int32_t, const AdamConsts&, bool);

#if defined(INF_HAVE_SCALAR)
namespace scalar { void adam_range(float*, const void*, float*, float*, void*, int64_t, int32_t, int32_t, const AdamConsts&, bool);
INF_LOWBIT_DECL }
#endif
#if defined(INF_HAVE_AVX2)
namespace avx2 { void adam_range(float*, const void*, float*, float*, void*, int64_t, int32_t, int32_t, const AdamConsts&, bool);
INF_LOWBIT_DECL }
#endif
#if defined(INF_HAVE_AVX512)
namespace avx512 { void adam_range(float*, const void*, float*, float*, void*, int64_t, int32_t, int32_t, const AdamConsts&, bool);
INF_LOWBIT_DECL }
#endif
#if defined(INF_HAVE_NEON)
namespace neon { void adam_range(float*, const void*, float*, float*, void*, int64_t, int32_t, int32_t, const AdamConsts&, bool);
INF_LOWBIT_DECL }
#endif

// AdamW over a bf16 master p, updated in place by stochastic rounding
// ([Note: stochastic rounding of the bf16 master] in adam_bf16p.inc), with
// moments of mdt (F32, BF16, or I8 with scales ms, vs; [0, n) then starts at a
// block boundary); k_step: the Note's K, index0: element 0's index in its tensor.
using Bf16pRangeFn = void (*)(uint16_t* p, const void* g, void* m, void* v, float* ms, float* vs, int64_t n,
                              int32_t grad_dtype, int32_t moment_dtype, const AdamConsts& c, uint64_t k_step,
                              uint64_t index0);
#define INF_BF16P_DECL void bf16p_range(uint16_t*, const void*, void*, void*, float*, float*, int64_t, int32_t, \
                                        int32_t, const AdamConsts&, uint64_t, uint64_t);
#if defined(INF_HAVE_SCALAR)
namespace scalar { INF_BF16P_DECL }
#endif
#if defined(INF_HAVE_AVX2)
namespace avx2 { INF_BF16P_DECL }
#endif
#if defined(INF_HAVE_AVX512)
namespace avx512 { INF_BF16P_DECL }
#endif
#if defined(INF_HAVE_NEON)
namespace neon { INF_BF16P_DECL }
#endif

// The sum of squares (in double) of a block's n elements of dt (F32, BF16 or
// F16), in the fixed order of [Note: a fixed-split sum of squares] in
// sumsq_kernel.inc: the same bits on every ISA.
using SumsqBlockFn = double (*)(const void* x, int64_t n, int32_t dt);
#define INF_SUMSQ_DECL double sumsq_block(const void*, int64_t, int32_t);
#if defined(INF_HAVE_SCALAR)
namespace scalar { INF_SUMSQ_DECL }
#endif
#if defined(INF_HAVE_AVX2)
namespace avx2 { INF_SUMSQ_DECL }
#endif
#if defined(INF_HAVE_AVX512)
namespace avx512 { INF_SUMSQ_DECL }
#endif
#if defined(INF_HAVE_NEON)
namespace neon { INF_SUMSQ_DECL }
#endif

}  // namespace infinity_native
