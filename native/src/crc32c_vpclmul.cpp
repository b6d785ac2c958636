// CRC32C by carry-less multiplication folding (AVX-512 + VPCLMULQDQ).
//
// Why: the crc32 instruction retires 8 bytes a cycle at best, so one core
// checksums swap traffic at 16-21 GB/s from DRAM, and on a 2-core machine
// that time comes straight out of compute. Folding with 512-bit carry-less
// multiplies takes 64 bytes an instruction pair and runs at memory speed.
//
// Method (reflected CRC, as in Intel's "Fast CRC Computation for Generic
// Polynomials Using PCLMULQDQ"): each 128-bit lane X of data is carried N
// bytes forward as clmul(X.lo, K_lo(N)) ^ clmul(X.hi, K_hi(N)), which has the
// same CRC as X followed by N zero bytes; XORing in the data found there
// keeps the invariant. At the end, one 128-bit lane remains and two crc32
// instructions reduce it. The constants are x^e mod P (bit-reflected) for
// the exponents in the comments, and are checked by the tests against the
// table implementation over many lengths and alignments.
//
// Only the functions here are compiled for AVX-512/VPCLMULQDQ (target
// attribute); crc32c.cpp calls them only when CPUID and XCR0 say so.
#if defined(__x86_64__)
#include <immintrin.h>
#include <string.h>

#include "crc32c.h"

#define INF_VPCLMUL __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))

namespace infinity_native {
namespace crc {

namespace {
// (K_lo, K_hi) that fold a lane forward by N bytes: x^(8N+31) and x^(8N-33) mod P.
constexpr uint64_t kFold16[2] = {0xf20c0dfe, 0x493c7d27};
constexpr uint64_t kFold32[2] = {0x3da6d0cb, 0xba4fc28e};
constexpr uint64_t kFold48[2] = {0x1c291d04, 0xddc0152b};
constexpr uint64_t kFold64[2] = {0x740eef02, 0x9e4addf8};
constexpr uint64_t kFold256[2] = {0xdcb17aa4, 0xb9e02b86};

INF_VPCLMUL inline __m512i fold(__m512i x, __m512i k, __m512i next) {
  const __m512i lo = _mm512_clmulepi64_epi128(x, k, 0x00);
  const __m512i hi = _mm512_clmulepi64_epi128(x, k, 0x11);
  return _mm512_ternarylogic_epi64(lo, hi, next, 0x96);  // lo ^ hi ^ next
}

INF_VPCLMUL inline __m512i broadcast(const uint64_t k[2]) {
  return _mm512_broadcast_i32x4(_mm_set_epi64x(static_cast<long long>(k[1]), static_cast<long long>(k[0])));
}
}  // namespace

INF_VPCLMUL uint32_t update_vpclmul(uint32_t crc, const unsigned char* p, size_t n) {
  if (n < 256 + 64) return update_sse42(crc, p, n);
  // Four accumulators of 64 bytes; the running CRC enters as the first bytes.
  __m512i x0 = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_castsi128_si512(_mm_cvtsi32_si128(static_cast<int>(crc))));
  __m512i x1 = _mm512_loadu_si512(p + 64);
  __m512i x2 = _mm512_loadu_si512(p + 128);
  __m512i x3 = _mm512_loadu_si512(p + 192);
  p += 256;
  n -= 256;
  const __m512i k256 = broadcast(kFold256);
  while (n >= 256) {
    x0 = fold(x0, k256, _mm512_loadu_si512(p));
    x1 = fold(x1, k256, _mm512_loadu_si512(p + 64));
    x2 = fold(x2, k256, _mm512_loadu_si512(p + 128));
    x3 = fold(x3, k256, _mm512_loadu_si512(p + 192));
    p += 256;
    n -= 256;
  }
  const __m512i k64 = broadcast(kFold64);
  x1 = fold(x0, k64, x1);
  x2 = fold(x1, k64, x2);
  __m512i x = fold(x2, k64, x3);
  while (n >= 64) {
    x = fold(x, k64, _mm512_loadu_si512(p));
    p += 64;
    n -= 64;
  }
  // Lanes 0..2 of x fold forward by 48, 32 and 16 bytes onto lane 3.
  const __m512i kl = _mm512_set_epi64(0, 0, static_cast<long long>(kFold16[1]), static_cast<long long>(kFold16[0]),
                                      static_cast<long long>(kFold32[1]), static_cast<long long>(kFold32[0]),
                                      static_cast<long long>(kFold48[1]), static_cast<long long>(kFold48[0]));
  const __m512i t = _mm512_xor_si512(_mm512_clmulepi64_epi128(x, kl, 0x00), _mm512_clmulepi64_epi128(x, kl, 0x11));
  __m128i a = _mm512_extracti32x4_epi32(x, 3);
  a = _mm_xor_si128(a, _mm512_castsi512_si128(t));
  a = _mm_xor_si128(a, _mm512_extracti32x4_epi32(t, 1));
  a = _mm_xor_si128(a, _mm512_extracti32x4_epi32(t, 2));
  uint64_t c = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(a)));
  c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(a, 1)));
  return update_sse42(static_cast<uint32_t>(c), p, n);
}

}  // namespace crc
}  // namespace infinity_native
#endif
