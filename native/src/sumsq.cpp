// Dispatch of the fixed-split sum of squares ([Note: a fixed-split sum of
// squares] in sumsq_kernel.inc): argument checks, the ISA's block function,
// blocks shared over the thread pool, their sums added in a fixed order.
#include <stdint.h>

#include <vector>

#include "infinity_native.h"
#include "isa.h"
#include "thread_pool.h"

using namespace infinity_native;

namespace {

constexpr int64_t kSumBlock = 1 << 16;  // elements a block, from each range's element 0

SumsqBlockFn sumsq_fn(int32_t isa) {
  switch (isa) {
#if defined(INF_HAVE_SCALAR)
    case INF_ISA_SCALAR: return scalar::sumsq_block;
#endif
#if defined(INF_HAVE_AVX2)
    case INF_ISA_AVX2: return avx2::sumsq_block;
#endif
#if defined(INF_HAVE_AVX512)
    case INF_ISA_AVX512: return avx512::sumsq_block;
#endif
#if defined(INF_HAVE_NEON)
    case INF_ISA_NEON: return neon::sumsq_block;
#endif
    default: return nullptr;
  }
}

struct SumJob {
  SumsqBlockFn fn;
  const int64_t* ptrs;
  const int64_t* numels;
  const int64_t* first;  // first[r] = range r's first global block; first[n_ranges] = all blocks
  int64_t n_ranges;
  int32_t dt;
  int esize;             // bytes an element
  int nthreads;
  double* sums;          // one per block
};

// Thread tid's share: blocks [all * tid / nthreads, all * (tid + 1) / nthreads).
void run_blocks(void* raw, int tid) {
  const SumJob& j = *static_cast<const SumJob*>(raw);
  const int64_t all = j.first[j.n_ranges];
  const int64_t lo = all * tid / j.nthreads, hi = all * (tid + 1) / j.nthreads;
  int64_t r = 0;
  for (int64_t b = lo; b < hi; ++b) {
    while (j.first[r + 1] <= b) ++r;
    const int64_t start = (b - j.first[r]) * kSumBlock;
    const int64_t left = j.numels[r] - start;
    const char* x = reinterpret_cast<const char*>(j.ptrs[r]) + start * j.esize;
    j.sums[b] = j.fn(x, left < kSumBlock ? left : kSumBlock, j.dt);
  }
}

int elem_size(int32_t dt) {
  switch (dt) {
    case INF_DT_F32: return 4;
    case INF_DT_BF16:
    case INF_DT_F16: return 2;
    default: return 0;
  }
}

}  // namespace

extern "C" {

int32_t inf_sum_squares(int32_t isa, int64_t n_ranges, const int64_t* ptrs, const int64_t* numels, int32_t dtype,
                        int32_t num_threads, double* out) {
  if (!out || n_ranges < 0 || (n_ranges > 0 && (!ptrs || !numels))) return INF_E_INVAL;
  const int esize = elem_size(dtype);
  if (esize == 0) return INF_E_INVAL;
  if (isa < 0) isa = inf_isa_best();
  if (isa >= INF_ISA_COUNT || !((inf_isa_compiled() & inf_isa_supported()) & (1u << isa))) return INF_E_ISA;
  const SumsqBlockFn fn = sumsq_fn(isa);
  if (!fn) return INF_E_ISA;
  std::vector<int64_t> first(n_ranges + 1);
  first[0] = 0;
  int64_t elems = 0;
  for (int64_t r = 0; r < n_ranges; ++r) {
    if (numels[r] < 0 || (numels[r] > 0 && ptrs[r] == 0)) return INF_E_INVAL;
    first[r + 1] = first[r] + (numels[r] + kSumBlock - 1) / kSumBlock;
    elems += numels[r];
  }
  const int64_t all = first[n_ranges];
  std::vector<double> sums(all);
  int nt = num_threads > 0 ? num_threads : default_threads();
  const int64_t by_size = elems / kMinElemsPerThread;
  if (by_size < nt) nt = by_size < 1 ? 1 : static_cast<int>(by_size);
  if (all < nt) nt = all < 1 ? 1 : static_cast<int>(all);
  SumJob job{fn, ptrs, numels, first.data(), n_ranges, dtype, esize, nt, sums.data()};
  if (all > 0) {
    if (nt == 1) run_blocks(&job, 0);
    else parallel_run(nt, run_blocks, &job);
  }
  double total = 0.0;  // in block order, whichever thread summed each
  for (int64_t b = 0; b < all; ++b) total += sums[b];
  *out = total;
  return INF_OK;
}

}  // extern "C"
