// CRC32C internals shared by the portable and the SSE4.2 translation units.
#pragma once
#include <stddef.h>
#include <stdint.h>

namespace infinity_native {
namespace crc {

// Lane length of the three-way interleaved hardware loop; the operator that
// advances a CRC over kLong zero bytes is tabulated in g_shift_long.
constexpr size_t kLong = 8192;
constexpr size_t kShort = 256;
extern uint32_t g_shift_long[4][256];
extern uint32_t g_shift_short[4][256];

// Advance a raw (non-inverted) CRC register over the zeros of a table.
inline uint32_t shift(const uint32_t t[4][256], uint32_t c) {
  return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
}

// Raw-register updates (no pre/post inversion).
uint32_t update_sw(uint32_t crc, const unsigned char* p, size_t n);
#if defined(__x86_64__)
uint32_t update_sse42(uint32_t crc, const unsigned char* p, size_t n);
// AVX-512 + VPCLMULQDQ folding; falls back to update_sse42 for short inputs.
uint32_t update_vpclmul(uint32_t crc, const unsigned char* p, size_t n);
#endif

}  // namespace crc
}  // namespace infinity_native
