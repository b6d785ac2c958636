// Dispatch of AdamW over bf16 or block-scaled 8-bit moments
// (inf_adam_step_moments): ISA choice, argument checks, and the split of a
// multi-tensor call over the thread pool. fp32 moments go to adam.cpp's path
// unchanged. The kernels are in adam_q8.inc.
#include <stdint.h>

#include <vector>

#include "infinity_native.h"
#include "isa.h"
#include "thread_pool.h"
#include "thread_split.h"

using namespace infinity_native;

namespace {

LowbitRangeFn lowbit_fn(int32_t isa) {
  switch (isa) {
#if defined(INF_HAVE_SCALAR)
    case INF_ISA_SCALAR: return scalar::lowbit_range;
#endif
#if defined(INF_HAVE_AVX2)
    case INF_ISA_AVX2: return avx2::lowbit_range;
#endif
#if defined(INF_HAVE_AVX512)
    case INF_ISA_AVX512: return avx512::lowbit_range;
#endif
#if defined(INF_HAVE_NEON)
    case INF_ISA_NEON: return neon::lowbit_range;
#endif
    default: return nullptr;
  }
}

int size_of(int32_t dt) { return dt == INF_DT_F32 ? 4 : (dt == INF_DT_BF16 || dt == INF_DT_F16) ? 2 : 0; }

// Work is split in units: elements for bf16 moments (thread bounds at
// multiples of kChunkAlign, as adam.cpp), whole blocks for 8-bit ones, so a
// block's scale is never shared by two threads.
struct LowbitJob {
  LowbitRangeFn fn;
  const int64_t* ptrs;
  const int64_t* numels;
  int64_t n_tensors;
  const int64_t* prefix;  // prefix[i] = first global unit of tensor i
  int64_t unit, align;    // elements a unit; thread bounds at multiples of align units
  int32_t gdt, odt, mdt;
  int gsize, osize, msize;
  AdamConsts c;
  bool probe;
  int nthreads;
};

void run_lowbit_chunk(void* raw, int tid) {
  const LowbitJob& j = *static_cast<const LowbitJob*>(raw);
  const int64_t n = j.n_tensors;
  for_thread_share(j.prefix, j.numels, n, j.unit, j.align, j.nthreads, tid,
                   [&](int64_t t, int64_t s, int64_t first, int64_t count) {
    const TensorSlice b = slice_at(j.ptrs, n, t, first, s, 4, j.gsize, j.msize, j.osize, j.mdt == INF_DT_I8);
    j.fn(reinterpret_cast<float*>(b.p), b.g, b.m, b.v, b.ms, b.vs, b.o, count, j.gdt, j.odt, j.mdt, j.c, j.probe);
  });
}

int32_t run_lowbit(int32_t isa, int64_t n_tensors, const int64_t* ptrs, const int64_t* numels, int32_t gdt,
                   int32_t odt, int32_t mdt, const AdamConsts& c, int32_t num_threads, bool probe) {
  if (n_tensors < 0 || (n_tensors > 0 && (!ptrs || !numels))) return INF_E_INVAL;
  if (size_of(gdt) == 0 || (odt != INF_DT_NONE && size_of(odt) == 0)) return INF_E_INVAL;
  if (mdt != INF_DT_BF16 && mdt != INF_DT_I8) return INF_E_INVAL;
  if (isa < 0) isa = inf_isa_best();
  if (!((inf_isa_compiled() & inf_isa_supported()) & (1u << isa))) return INF_E_ISA;
  LowbitRangeFn fn = lowbit_fn(isa);
  if (!fn) return INF_E_ISA;
  if (n_tensors == 0) return INF_OK;
  const bool q8 = mdt == INF_DT_I8;
  const int64_t unit = q8 ? INF_QBLOCK : 1;
  std::vector<int64_t> prefix(n_tensors + 1);
  prefix[0] = 0;
  for (int64_t i = 0; i < n_tensors; ++i) {
    if (numels[i] < 0) return INF_E_INVAL;
    if (numels[i] > 0) {
      for (int k = 0; k < 4; ++k)
        if (ptrs[k * n_tensors + i] == 0) return INF_E_INVAL;
      if (odt != INF_DT_NONE && ptrs[4 * n_tensors + i] == 0) return INF_E_INVAL;
      if (q8 && (ptrs[5 * n_tensors + i] == 0 || ptrs[6 * n_tensors + i] == 0)) return INF_E_INVAL;
    }
    prefix[i + 1] = prefix[i] + (numels[i] + unit - 1) / unit;
  }
  const int64_t elems = prefix[n_tensors] * unit;
  int nt = num_threads > 0 ? num_threads : default_threads();
  const int64_t by_size = elems / kMinElemsPerThread;
  if (by_size < nt) nt = by_size < 1 ? 1 : static_cast<int>(by_size);
  LowbitJob job{fn, ptrs, numels, n_tensors, prefix.data(), unit, q8 ? 1 : kChunkAlign, gdt, odt, mdt,
                size_of(gdt), odt == INF_DT_NONE ? 0 : size_of(odt), q8 ? 1 : 2, c, probe, nt};
  parallel_run(nt, run_lowbit_chunk, &job);
  return INF_OK;
}

}  // namespace

extern "C" {

int32_t inf_adam_step_moments(int32_t isa, int64_t n_tensors, const int64_t* ptrs, const int64_t* numels,
                              int32_t grad_dtype, int32_t out_dtype, int32_t moment_dtype,
                              const inf_adam_hparams* hp) {
  if (!hp) return INF_E_INVAL;
  // fp32 moments: the first five arrays are inf_adam_step's.
  if (moment_dtype == INF_DT_F32) return inf_adam_step(isa, n_tensors, ptrs, numels, grad_dtype, out_dtype, hp);
  return run_lowbit(isa, n_tensors, ptrs, numels, grad_dtype, out_dtype, moment_dtype, adam_consts(*hp),
                    hp->num_threads, false);
}

int32_t inf_probe_step_moments(int32_t isa, int64_t n_tensors, const int64_t* ptrs, const int64_t* numels,
                               int32_t grad_dtype, int32_t out_dtype, int32_t moment_dtype,
                               int32_t num_threads) {
  if (moment_dtype == INF_DT_F32)
    return inf_probe_step(isa, n_tensors, ptrs, numels, grad_dtype, out_dtype, num_threads);
  AdamConsts c{};
  c.grad_scale = 1e-6f;  // keeps repeated probes finite
  return run_lowbit(isa, n_tensors, ptrs, numels, grad_dtype, out_dtype, moment_dtype, c, num_threads, true);
}

}  // extern "C"
