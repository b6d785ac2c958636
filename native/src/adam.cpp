// Dispatch of the AdamW kernels: ISA choice, argument checks, and splitting
// a multi-tensor call over the thread pool by element count.
#include <math.h>
#include <stdint.h>

#include <string.h>

#include <algorithm>
#include <vector>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "build_info.h"
#include "chunk_rule.h"
#include "infinity_io.h"
#include "infinity_native.h"
#include "isa.h"
#include "thread_pool.h"

using namespace infinity_native;

namespace {

uint32_t compiled_mask() {
  uint32_t m = 0;
#if defined(INF_HAVE_SCALAR)
  m |= 1u << INF_ISA_SCALAR;
#endif
#if defined(INF_HAVE_AVX2)
  m |= 1u << INF_ISA_AVX2;
#endif
#if defined(INF_HAVE_AVX512)
  m |= 1u << INF_ISA_AVX512;
#endif
#if defined(INF_HAVE_NEON)
  m |= 1u << INF_ISA_NEON;
#endif
  return m;
}

RangeFn range_fn(int32_t isa) {
  switch (isa) {
#if defined(INF_HAVE_SCALAR)
    case INF_ISA_SCALAR: return scalar::adam_range;
#endif
#if defined(INF_HAVE_AVX2)
    case INF_ISA_AVX2: return avx2::adam_range;
#endif
#if defined(INF_HAVE_AVX512)
    case INF_ISA_AVX512: return avx512::adam_range;
#endif
#if defined(INF_HAVE_NEON)
    case INF_ISA_NEON: return neon::adam_range;
#endif
    default: return nullptr;
  }
}

struct Job {
  RangeFn fn;
  const int64_t* ptrs;
  int64_t n_tensors;
  const int64_t* prefix;  // prefix[i] = first global element of tensor i; prefix[n] = total
  int32_t gdt, odt;
  int gsize, osize;       // bytes per element of grad and out
  AdamConsts c;
  bool probe;
  int nthreads;
  // Sums mode (inf_adam_step_sums): work is split by checksum chunk.
  int64_t chunk_bytes = 0;       // bytes per checksum chunk
  const int64_t* item_prefix = nullptr;  // item_prefix[i] = first chunk of tensor i
  const int64_t* sums = nullptr; // 3*n_tensors uint32 arrays: params, exp_avg, exp_avg_sq
  // Save mode (inf_adam_step_save): 4*n_tensors addresses the old bytes go to.
  const int64_t* saves = nullptr;
};

int dt_size(int32_t dt) {
  switch (dt) {
    case INF_DT_F32: return 4;
    case INF_DT_BF16:
    case INF_DT_F16: return 2;
    default: return 0;
  }
}

// [Note: the undo state saved in the step's pass]
// A speculative update (engine/step/speculate.py) must keep the bytes it
// overwrites. Copied beforehand (torch copy_), that is a second pass over
// DRAM reading 16 bytes a parameter and writing 16 (plus the reads for
// ownership), about twice the step itself. Here each thread copies a tile
// of its range to the save buffers just before the kernel steps that tile:
// the kernel then reads it from cache, so what the save adds is only its
// writes, streamed (non-temporal: no read for ownership, and the undo state
// is read again only by a rollback). The compute copy's old bytes are
// saved only where the caller asks (a 0 address: not kept): an fp32 copy
// is the master's bits, so a rollback takes it from the saved master. The kernel is the unchanged per-element
// kernel over the same elements, so the new values are inf_adam_step's bit
// for bit on every ISA.
constexpr int64_t kSaveTile = 4096;  // elements: 16 KiB of each fp32 stream

void save_bytes(void* dst, const void* src, int64_t bytes) {
#if defined(__SSE2__)
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  for (; bytes > 0 && (reinterpret_cast<uintptr_t>(d) & 15); --bytes) *d++ = *s++;
  for (; bytes >= 64; bytes -= 64, d += 64, s += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
  }
  if (bytes > 0) memcpy(d, s, static_cast<size_t>(bytes));
#else
  memcpy(dst, src, static_cast<size_t>(bytes));
#endif
}

// Streaming stores are weakly ordered: fenced before the thread reports done.
void save_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// Elements [s, e) of tensor t (p, g, m, v, o already offset by s), saving
// the old p, m, v and o tile by tile first.
void step_saving(const Job& j, int64_t t, int64_t s, int64_t e, float* p, const char* g, float* m, float* v,
                 char* o) {
  const int64_t n = j.n_tensors;
  float* sp = reinterpret_cast<float*>(j.saves[t]) + s;
  float* sm = reinterpret_cast<float*>(j.saves[n + t]) + s;
  float* sv = reinterpret_cast<float*>(j.saves[2 * n + t]) + s;
  char* so = o && j.saves[3 * n + t] ? reinterpret_cast<char*>(j.saves[3 * n + t]) + s * j.osize : nullptr;
  for (int64_t i = 0; i < e - s; i += kSaveTile) {
    const int64_t k = std::min(kSaveTile, e - s - i);
    save_bytes(sp + i, p + i, 4 * k);
    save_bytes(sm + i, m + i, 4 * k);
    save_bytes(sv + i, v + i, 4 * k);
    if (so) save_bytes(so + i * j.osize, o + i * j.osize, k * j.osize);
    j.fn(p + i, g + i * j.gsize, m + i, v + i, o ? o + i * j.osize : nullptr, k, j.gdt, j.odt, j.c, false);
  }
}

void run_chunk(void* raw, int tid) {
  const Job& j = *static_cast<const Job*>(raw);
  const int64_t total = j.prefix[j.n_tensors];
  auto bound = [&](int t) {
    int64_t b = total * t / j.nthreads;
    b -= b % kChunkAlign;
    return t == j.nthreads ? total : b;
  };
  int64_t lo = bound(tid), hi = bound(tid + 1);
  if (lo >= hi) return;
  // First tensor that ends after lo (binary search over the prefix sums).
  int64_t a = 0, b = j.n_tensors - 1;
  while (a < b) {
    const int64_t mid = (a + b) / 2;
    if (j.prefix[mid + 1] <= lo) a = mid + 1; else b = mid;
  }
  const int64_t n = j.n_tensors;
  for (int64_t t = a; t < n && j.prefix[t] < hi; ++t) {
    const int64_t s = (lo > j.prefix[t] ? lo : j.prefix[t]) - j.prefix[t];
    const int64_t e = (hi < j.prefix[t + 1] ? hi : j.prefix[t + 1]) - j.prefix[t];
    if (e <= s) continue;
    float* p = reinterpret_cast<float*>(j.ptrs[t]) + s;
    const char* g = reinterpret_cast<const char*>(j.ptrs[n + t]) + s * j.gsize;
    float* m = reinterpret_cast<float*>(j.ptrs[2 * n + t]) + s;
    float* v = reinterpret_cast<float*>(j.ptrs[3 * n + t]) + s;
    char* o = j.osize ? reinterpret_cast<char*>(j.ptrs[4 * n + t]) + s * j.osize : nullptr;
    if (j.saves) step_saving(j, t, s, e, p, g, m, v, o);
    else j.fn(p, g, m, v, o, e - s, j.gdt, j.odt, j.c, j.probe);
  }
  if (j.saves) save_fence();
}

// [Note: sums from the producer]
// A swap store checksums what it writes. Taken by the store, the sum is a
// second pass over DRAM while the disk reads the same buffer, and on the
// test VM it cost 6-18% of overwrite bandwidth. The step has just written
// the bytes, so here the three state buffers are updated a tile at a time
// and each tile is summed while it is still in L1/L2. The sums follow the
// store's chunk rule (chunks of chunk_bytes from byte 0, cut at the 4 KiB
// floor of the size, then the unaligned tail), so a write can pass them on.
constexpr int64_t kSumTile = 4096;  // elements: 16 KiB of each fp32 stream

void run_sum_chunks(void* raw, int tid) {
  const Job& j = *static_cast<const Job*>(raw);
  const int64_t n = j.n_tensors;
  const int64_t total = j.item_prefix[n];
  const int64_t lo = total * tid / j.nthreads, hi = total * (tid + 1) / j.nthreads;
  int64_t t = 0;
  while (j.item_prefix[t + 1] <= lo) t++;
  for (int64_t it = lo; it < hi; it++) {
    while (j.item_prefix[t + 1] <= it) t++;
    const int64_t c = it - j.item_prefix[t];
    const int64_t numel = j.prefix[t + 1] - j.prefix[t];
    int64_t a, b;  // bytes, then elements (every bound is a multiple of 4)
    sum_chunk_range(c, 4 * numel, j.chunk_bytes, &a, &b);
    a /= 4;
    b /= 4;
    float* p = reinterpret_cast<float*>(j.ptrs[t]);
    const char* g = reinterpret_cast<const char*>(j.ptrs[n + t]);
    float* m = reinterpret_cast<float*>(j.ptrs[2 * n + t]);
    float* v = reinterpret_cast<float*>(j.ptrs[3 * n + t]);
    char* o = j.osize ? reinterpret_cast<char*>(j.ptrs[4 * n + t]) : nullptr;
    uint32_t cp = 0, cm = 0, cv = 0;
    for (int64_t i = a; i < b; i += kSumTile) {
      const int64_t k = std::min(kSumTile, b - i);
      j.fn(p + i, g + i * j.gsize, m + i, v + i, o ? o + i * j.osize : nullptr, k, j.gdt, j.odt, j.c, false);
      cp = inf_crc32c(cp, p + i, 4 * k);
      cm = inf_crc32c(cm, m + i, 4 * k);
      cv = inf_crc32c(cv, v + i, 4 * k);
    }
    reinterpret_cast<uint32_t*>(j.sums[t])[c] = cp;
    reinterpret_cast<uint32_t*>(j.sums[n + t])[c] = cm;
    reinterpret_cast<uint32_t*>(j.sums[2 * n + t])[c] = cv;
  }
}

int32_t run(int32_t isa, int64_t n_tensors, const int64_t* ptrs, const int64_t* numels,
            int32_t gdt, int32_t odt, const AdamConsts& c, int32_t num_threads, bool probe,
            int64_t chunk_bytes = 0, const int64_t* sums = nullptr, const int64_t* saves = nullptr) {
  if (n_tensors < 0 || (n_tensors > 0 && (!ptrs || !numels))) return INF_E_INVAL;
  if (dt_size(gdt) == 0) return INF_E_INVAL;
  if (odt != INF_DT_NONE && dt_size(odt) == 0) return INF_E_INVAL;
  if (isa < 0) isa = inf_isa_best();
  if (!((inf_isa_compiled() & inf_isa_supported()) & (1u << isa))) return INF_E_ISA;
  RangeFn fn = range_fn(isa);
  if (!fn) return INF_E_ISA;
  if (n_tensors == 0) return INF_OK;

  std::vector<int64_t> prefix(n_tensors + 1);
  prefix[0] = 0;
  for (int64_t i = 0; i < n_tensors; ++i) {
    if (numels[i] < 0) return INF_E_INVAL;
    if (numels[i] > 0) {
      for (int k = 0; k < 4; ++k)
        if (ptrs[k * n_tensors + i] == 0) return INF_E_INVAL;
      if (odt != INF_DT_NONE && ptrs[4 * n_tensors + i] == 0) return INF_E_INVAL;
    }
    prefix[i + 1] = prefix[i] + numels[i];
  }
  const int64_t total = prefix[n_tensors];
  int nt = num_threads > 0 ? num_threads : default_threads();
  const int64_t by_size = total / kMinElemsPerThread;
  if (by_size < nt) nt = by_size < 1 ? 1 : static_cast<int>(by_size);

  Job job{fn, ptrs, n_tensors, prefix.data(), gdt, odt, dt_size(gdt),
          odt == INF_DT_NONE ? 0 : dt_size(odt), c, probe, nt};
  if (saves) {
    for (int64_t i = 0; i < n_tensors; ++i) {
      if (numels[i] == 0) continue;
      for (int k = 0; k < 3; ++k)
        if (saves[k * n_tensors + i] == 0) return INF_E_INVAL;
    }
    job.saves = saves;
  }
  if (!sums) {
    parallel_run(nt, run_chunk, &job);
    return INF_OK;
  }
  std::vector<int64_t> items(n_tensors + 1);
  items[0] = 0;
  for (int64_t i = 0; i < n_tensors; ++i) {
    if (numels[i] > 0)
      for (int k = 0; k < 3; ++k)
        if (sums[k * n_tensors + i] == 0) return INF_E_INVAL;
    items[i + 1] = items[i] + sum_chunk_count(4 * numels[i], chunk_bytes);
  }
  if (items[n_tensors] < nt) nt = static_cast<int>(items[n_tensors] < 1 ? 1 : items[n_tensors]);
  job.nthreads = nt;
  job.chunk_bytes = chunk_bytes;
  job.item_prefix = items.data();
  job.sums = sums;
  parallel_run(nt, run_sum_chunks, &job);
  return INF_OK;
}

}  // namespace

namespace infinity_native {
AdamConsts adam_consts(const inf_adam_hparams& hp) {
  AdamConsts c;
  const double lr = hp.lr, wd = hp.weight_decay;
  c.adamw = hp.adamw_mode != 0;
  c.lr_decay = c.adamw ? static_cast<float>(1.0 - lr * wd) : 1.0f;
  c.l2 = c.adamw ? 0.0f : static_cast<float>(wd);
  c.one_minus_b1 = static_cast<float>(1.0 - hp.beta1);
  c.beta2 = static_cast<float>(hp.beta2);
  c.one_minus_b2 = static_cast<float>(1.0 - hp.beta2);
  c.neg_step_size = static_cast<float>(-(lr / hp.bias_correction1));
  c.bc2_sqrt = static_cast<float>(sqrt(hp.bias_correction2));
  c.eps = static_cast<float>(hp.eps);
  c.grad_scale = static_cast<float>(hp.grad_scale);
  return c;
}
}  // namespace infinity_native

extern "C" {

uint32_t inf_isa_compiled(void) { return compiled_mask(); }
uint32_t inf_isa_supported(void) { return inf_cpu_isa_mask(); }

int32_t inf_isa_best(void) {
  const uint32_t ok = compiled_mask() & inf_cpu_isa_mask();
  for (int32_t isa : {INF_ISA_AVX512, INF_ISA_NEON, INF_ISA_AVX2, INF_ISA_SCALAR})
    if (ok & (1u << isa)) return isa;
  return INF_ISA_SCALAR;
}

const char* inf_build_info(void) { return INF_BUILD_FLAGS; }

int32_t inf_default_threads(void) { return default_threads(); }

namespace {
int32_t adam_call(int32_t isa, int64_t n_tensors, const int64_t* ptrs, const int64_t* numels,
                  int32_t grad_dtype, int32_t out_dtype, const inf_adam_hparams* hp, int64_t chunk_bytes,
                  const int64_t* sums) {
  if (!hp) return INF_E_INVAL;
  const AdamConsts c = adam_consts(*hp);
  return run(isa, n_tensors, ptrs, numels, grad_dtype, out_dtype, c, hp->num_threads, false, chunk_bytes, sums);
}
}  // namespace

int32_t inf_adam_step(int32_t isa, int64_t n_tensors, const int64_t* ptrs, const int64_t* numels,
                      int32_t grad_dtype, int32_t out_dtype, const inf_adam_hparams* hp) {
  return adam_call(isa, n_tensors, ptrs, numels, grad_dtype, out_dtype, hp, 0, nullptr);
}

int32_t inf_adam_step_sums(int32_t isa, int64_t n_tensors, const int64_t* ptrs, const int64_t* numels,
                           int32_t grad_dtype, int32_t out_dtype, const inf_adam_hparams* hp,
                           int64_t chunk_bytes, const int64_t* sums) {
  if (!sums || chunk_bytes < 4096 || (chunk_bytes & (chunk_bytes - 1))) return INF_E_INVAL;
  return adam_call(isa, n_tensors, ptrs, numels, grad_dtype, out_dtype, hp, chunk_bytes, sums);
}

int32_t inf_adam_step_save(int32_t isa, int64_t n_tensors, const int64_t* ptrs, const int64_t* numels,
                           int32_t grad_dtype, int32_t out_dtype, const inf_adam_hparams* hp, const int64_t* saves) {
  if (!hp || !saves) return INF_E_INVAL;
  const AdamConsts c = adam_consts(*hp);
  return run(isa, n_tensors, ptrs, numels, grad_dtype, out_dtype, c, hp->num_threads, false, 0, nullptr, saves);
}

int32_t inf_probe_step(int32_t isa, int64_t n_tensors, const int64_t* ptrs, const int64_t* numels,
                       int32_t grad_dtype, int32_t out_dtype, int32_t num_threads) {
  AdamConsts c{};
  c.grad_scale = 1e-6f;  // keeps repeated probes finite
  return run(isa, n_tensors, ptrs, numels, grad_dtype, out_dtype, c, num_threads, true);
}

}  // extern "C"
