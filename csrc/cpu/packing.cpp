// grace CPU kernels: bit packing of codes (see common.h)
#include "bitpack.h"

namespace {
template <int B>
void pack_groups(const uint8_t* codes, uint8_t* out, int64_t g0, int64_t g1) {
  int64_t g = g0;
#ifdef GRACE_SIMD
  for (; g + 2 <= g1; g += 2) put16<B>(out, g, g1, pack16<B>(_mm_loadu_si128((const __m128i*)(codes + 8 * g))));
#endif
  for (; g < g1; ++g) put_group<B>(out, g, g1, pack_word<B>(load_u64(codes + 8 * g)));
}

template <int B>
void unpack_groups(const uint8_t* packed, uint8_t* codes, int64_t g0, int64_t g1, int64_t nbytes) {
  int64_t g = g0;
#ifdef GRACE_SIMD
  for (; g + 2 <= g1 && g * B + 16 <= nbytes; g += 2)
    _mm_storeu_si128((__m128i*)(codes + 8 * g), unpack16<B>(_mm_loadu_si128((const __m128i*)(packed + g * B))));
#endif
  for (; g < g1; ++g) {
    uint64_t w = unpack_word<B>(get_group<B>(packed, g, nbytes));
    std::memcpy(codes + 8 * g, &w, 8);
  }
}
}  // namespace
// ---- packing ---------------------------------------------------------------------------------
API int grace_cpu_pack(const uint8_t* codes, int64_t n, int bits, uint8_t* out) {
  if (bits < 1 || bits > 8 || n < 0) return -1;
  const int64_t full = n / 8, rem = n % 8;
  with_width(bits, [&](auto w) {
    constexpr int B = decltype(w)::value;
    for_chunks(full, 1, threads_for(n), [&](int, int64_t g0, int64_t g1) { pack_groups<B>(codes, out, g0, g1); });
    if (rem) {
      uint64_t c = 0;
      std::memcpy(&c, codes + 8 * full, rem);
      uint64_t p = pack_word<B>(c);
      std::memcpy(out + full * B, &p, (rem * B + 7) / 8);
    }
  });
  return 0;
}

API int grace_cpu_unpack(const uint8_t* packed, int64_t n, int bits, uint8_t* codes) {
  if (bits < 1 || bits > 8 || n < 0) return -1;
  const int64_t full = n / 8, rem = n % 8, nbytes = (n * bits + 7) / 8;
  with_width(bits, [&](auto w) {
    constexpr int B = decltype(w)::value;
    for_chunks(full, 1, threads_for(n), [&](int, int64_t g0, int64_t g1) {
      unpack_groups<B>(packed, codes, g0, g1, nbytes);
    });
    if (rem) {
      uint64_t c = unpack_word<B>(get_group<B>(packed, full, nbytes, (int)rem));
      std::memcpy(codes + 8 * full, &c, rem);
    }
  });
  return 0;
}
