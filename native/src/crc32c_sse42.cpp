// SSE4.2 CRC32C: three interleaved streams of kLong (then kShort) bytes,
// recombined with the zero-shift tables. Only the functions here are compiled
// for SSE4.2 (target attribute, the file's own flag), and they are called only
// when CPUID reports SSE4.2 (see crc32c.cpp); the rest of the library keeps
// the baseline ISA.
#if defined(__x86_64__)
#include <nmmintrin.h>
#include <string.h>

#include "crc32c.h"

#define INF_SSE42 __attribute__((target("sse4.2")))

namespace infinity_native {
namespace crc {

namespace {
constexpr size_t kAhead = 4096;  // bytes

INF_SSE42 inline uint64_t load64(const unsigned char* p) {
  uint64_t w;
  memcpy(&w, p, 8);
  return w;
}

// Three lanes of `lane` bytes each; returns the combined raw CRC.
INF_SSE42 inline const unsigned char* three_way(uint64_t& c0, const unsigned char* p, size_t lane,
                                      const uint32_t t[4][256]) {
  uint64_t c1 = 0, c2 = 0;
  const unsigned char* end = p + lane;
  // Software prefetch a few lines ahead on each lane: from DRAM the three
  // far-apart streams otherwise stall the crc32 chain (16 GB/s instead of 30+).
  if (lane >= 4096) {
    do {
      __builtin_prefetch(p + kAhead);
      __builtin_prefetch(p + lane + kAhead);
      __builtin_prefetch(p + 2 * lane + kAhead);
      for (int k = 0; k < 64; k += 8) {
        c0 = _mm_crc32_u64(c0, load64(p + k));
        c1 = _mm_crc32_u64(c1, load64(p + lane + k));
        c2 = _mm_crc32_u64(c2, load64(p + 2 * lane + k));
      }
      p += 64;
    } while (p < end);
  } else {
    do {
      c0 = _mm_crc32_u64(c0, load64(p));
      c1 = _mm_crc32_u64(c1, load64(p + lane));
      c2 = _mm_crc32_u64(c2, load64(p + 2 * lane));
      p += 8;
    } while (p < end);
  }
  c0 = shift(t, static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
  c0 = shift(t, static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c2);
  return p + 2 * lane;
}
}  // namespace

INF_SSE42 uint32_t update_sse42(uint32_t crc, const unsigned char* p, size_t n) {
  uint64_t c = crc;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    n--;
  }
  while (n >= 3 * kLong) {
    p = three_way(c, p, kLong, g_shift_long);
    n -= 3 * kLong;
  }
  while (n >= 3 * kShort) {
    p = three_way(c, p, kShort, g_shift_short);
    n -= 3 * kShort;
  }
  while (n >= 8) {
    c = _mm_crc32_u64(c, load64(p));
    p += 8;
    n -= 8;
  }
  while (n--) c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
  return static_cast<uint32_t>(c);
}

}  // namespace crc
}  // namespace infinity_native
#endif
