/* C ABI of infinity's native library.
 *
 * Every entry point takes raw pointers and lengths (elements or bytes, as
 * named) and returns 0 on success or a negative INF_E* code. Python binds it
 * with ctypes (infinity/_native.py), which releases the GIL for each call.
 * No PyTorch header is used, so one build serves every torch version.
 */
#ifndef INFINITY_NATIVE_H
#define INFINITY_NATIVE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define INF_API __attribute__((visibility("default")))

/* Error codes. */
#define INF_OK 0
#define INF_E_INVAL (-1)     /* bad argument (null pointer, bad dtype, n < 0) */
#define INF_E_ISA (-2)       /* ISA not compiled in or not supported by this CPU */

/* ISA levels, ordered by preference. */
#define INF_ISA_SCALAR 0
#define INF_ISA_AVX2 1
#define INF_ISA_AVX512 2
#define INF_ISA_NEON 3
#define INF_ISA_COUNT 4

/* Element types of gradients and of the optional parameter copy-out. */
#define INF_DT_NONE 0   /* no copy-out */
#define INF_DT_F32 1
#define INF_DT_BF16 2
#define INF_DT_F16 3
/* Moments only: block-scaled 8-bit codes, one fp32 scale per block of
 * INF_QBLOCK elements ([Note: 8-bit moments] in native/src/adam_q8.inc). */
#define INF_DT_I8 4
#define INF_QBLOCK 256

/* Hyper-parameters of one AdamW/Adam call. Doubles, as Python floats are:
 * derived constants (step size, 1 - beta, ...) are computed in double and
 * rounded once to fp32, as torch does with its Python-scalar arguments. */
typedef struct inf_adam_hparams {
  double lr;               /* learning rate */
  double beta1, beta2;
  double eps;
  double weight_decay;
  double bias_correction1; /* 1 - beta1^step */
  double bias_correction2; /* 1 - beta2^step */
  double grad_scale;       /* gradients are multiplied by this (1/loss_scale); 1 = none */
  int32_t adamw_mode;      /* 1: decoupled weight decay (AdamW); 0: L2 (Adam) */
  int32_t num_threads;     /* <= 0: library default */
} inf_adam_hparams;

/* Which ISA levels were compiled in, and which the CPU and OS support
 * (CPUID + XGETBV). Bit i set = level i available. */
INF_API uint32_t inf_isa_compiled(void);
INF_API uint32_t inf_isa_supported(void);
/* Best level both compiled and supported. */
INF_API int32_t inf_isa_best(void);
/* Human-readable build description (compiler, flags per ISA). Static string. */
INF_API const char* inf_build_info(void);
/* Library default thread count (online CPUs in the affinity mask). */
INF_API int32_t inf_default_threads(void);

/* One fused AdamW (or Adam, adamw_mode=0) step over n_tensors tensors.
 *
 * ptrs holds 5*n_tensors addresses, as five consecutive arrays:
 *   params[n]  fp32 master weights, updated in place
 *   grads[n]   gradients of grad_dtype (F32, BF16 or F16), read only
 *   exp_avg[n], exp_avg_sq[n]  fp32 moments, updated in place
 *   outs[n]    copy-out of the updated params as out_dtype (NONE: ignored)
 * numels[n] are element counts. All buffers of one tensor hold numels[i]
 * elements; buffers must not overlap. Work is split over num_threads threads
 * by element count across tensors, so many small tensors cost one call. */
INF_API int32_t inf_adam_step(int32_t isa, int64_t n_tensors, const int64_t* ptrs,
                              const int64_t* numels, int32_t grad_dtype, int32_t out_dtype,
                              const inf_adam_hparams* hp);

/* inf_adam_step, and the CRC32C of every updated fp32 buffer, taken a tile at
 * a time while the tile is in cache ([Note: sums from the producer] in
 * adam.cpp). sums holds 3*n_tensors addresses of uint32 arrays (params[n],
 * exp_avg[n], exp_avg_sq[n]); array i receives one CRC32C per checksum chunk
 * of that buffer's numels[i]*4 bytes, by the swap store's rule: chunks of
 * chunk_bytes from byte 0, cut at the 4 KiB floor of the size, then one for
 * the unaligned tail (inf_io_crc_count entries). chunk_bytes: a power of two,
 * >= 4096. Work is split over threads by chunk. */
INF_API int32_t inf_adam_step_sums(int32_t isa, int64_t n_tensors, const int64_t* ptrs,
                                   const int64_t* numels, int32_t grad_dtype, int32_t out_dtype,
                                   const inf_adam_hparams* hp, int64_t chunk_bytes, const int64_t* sums);

/* inf_adam_step that first saves the bytes it overwrites ([Note: the undo
 * state saved in the step's pass] in adam.cpp): saves holds 4*n_tensors
 * addresses, as four arrays: params[n], exp_avg[n], exp_avg_sq[n] (fp32,
 * numels[i] each) and outs[n] (out_dtype; ignored with NONE; 0: not
 * kept), which receive the old contents of the matching buffers. The new values are those of
 * inf_adam_step, bit for bit. Save buffers must not overlap any other. */
INF_API int32_t inf_adam_step_save(int32_t isa, int64_t n_tensors, const int64_t* ptrs,
                                   const int64_t* numels, int32_t grad_dtype, int32_t out_dtype,
                                   const inf_adam_hparams* hp, const int64_t* saves);

/* inf_adam_step with the moments stored as moment_dtype: F32 (exactly
 * inf_adam_step), BF16 (rounded to nearest even) or I8 (block-scaled codes).
 * ptrs holds 7*n_tensors addresses: the five arrays of inf_adam_step (with
 * exp_avg and exp_avg_sq of moment_dtype), then
 *   exp_avg_scale[n], exp_avg_sq_scale[n]  fp32, ceil(numels[i]/INF_QBLOCK)
 *                                          each, updated in place (I8 only;
 *                                          ignored otherwise)
 * A tensor's blocks start at its element 0, so a shard stepped on its own
 * must start at a multiple of INF_QBLOCK of its tensor. Scales of a new state
 * are 0 with all-zero codes (moments of zero). */
INF_API int32_t inf_adam_step_moments(int32_t isa, int64_t n_tensors, const int64_t* ptrs,
                                      const int64_t* numels, int32_t grad_dtype, int32_t out_dtype,
                                      int32_t moment_dtype, const inf_adam_hparams* hp);

/* AdamW whose parameters are bf16 masters (no fp32 copy), updated in place:
 * each new value is computed in fp32 exactly as inf_adam_step_moments would
 * from the widened parameter, then stored by stochastic rounding with random
 * bits hashed from (seed, streams[i], step, the element's index in its
 * tensor) ([Note: stochastic rounding of the bf16 master] in
 * native/src/adam_bf16p.inc): the bytes do not depend on ISA, threads or
 * how tensors are split. ptrs holds 7*n_tensors addresses, as for
 * inf_adam_step_moments: params[n] bf16, grads[n] of grad_dtype, exp_avg[n],
 * exp_avg_sq[n] of moment_dtype (F32, BF16 or I8), outs[n] all 0 (the master
 * is the compute copy), exp_avg_scale[n], exp_avg_sq_scale[n] (I8 only;
 * ignored otherwise).
 * offsets[n]: index of each buffer's element 0 in its whole tensor (a shard
 * passes its start; a multiple of INF_QBLOCK for I8); NULL: all 0.
 * streams[n]: each tensor's id, mixed into its random bits; NULL: all 0.
 * step: the optimizer step (>= 1) of the rounding; seed: the run's. */
INF_API int32_t inf_adam_step_bf16p(int32_t isa, int64_t n_tensors, const int64_t* ptrs, const int64_t* numels,
                                    const int64_t* offsets, const uint64_t* streams, int32_t grad_dtype,
                                    int32_t moment_dtype, const inf_adam_hparams* hp, uint64_t seed,
                                    int64_t step);

/* The sum of the squares of every element of n_ranges ranges (ptrs[r]:
 * numels[r] contiguous elements of dtype F32, BF16 or F16), in double, into
 * *out. The order of the additions is fixed by each element's index in its
 * range ([Note: a fixed-split sum of squares] in native/src/sumsq_kernel.inc),
 * so the bits do not depend on the ISA, num_threads (<= 0: library default;
 * 1 runs on the calling thread) or the calling thread. No range: 0. NaN and
 * Inf propagate. */
INF_API int32_t inf_sum_squares(int32_t isa, int64_t n_ranges, const int64_t* ptrs, const int64_t* numels,
                                int32_t dtype, int32_t num_threads, double* out);

/* Memory-bandwidth probe with exactly the access pattern of inf_adam_step
 * (same loads, in-place stores and copy-out, same threading and ISA), but
 * trivial arithmetic. Its time gives the Adam roofline of this machine.
 * Contents of the buffers are changed (kept finite). */
INF_API int32_t inf_probe_step(int32_t isa, int64_t n_tensors, const int64_t* ptrs,
                               const int64_t* numels, int32_t grad_dtype, int32_t out_dtype,
                               int32_t num_threads);
/* The probe of inf_adam_step_moments (ptrs as there). */
INF_API int32_t inf_probe_step_moments(int32_t isa, int64_t n_tensors, const int64_t* ptrs,
                                       const int64_t* numels, int32_t grad_dtype, int32_t out_dtype,
                                       int32_t moment_dtype, int32_t num_threads);

#ifdef __cplusplus
}
#endif
#endif /* INFINITY_NATIVE_H */
