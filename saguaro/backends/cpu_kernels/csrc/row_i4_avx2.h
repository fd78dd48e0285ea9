// One row of int4 weights against two tiles at once, in AVX2 (vpmaddubsw): included by tier_avx2.h, and by
// tier_avx512_gemm.h, whose own kernel (vpdpbusd, 64-byte reads, one tile at a time) read the 24 int4 gate/up
// matrices of the 0.5B draft at 25-27 GB/s where this one reads 30-34 (Zen 4). Each value's arithmetic is the
// avx512 kernels' (exact int32 sums, then I4Scales' fp32 operations in the same order), so a row's bits are
// the same whichever ran it.

// One row's block b of an int4 tile, its bytes read in address order: code group g (k 8g..8g+7 of all 64
// outputs) outer, outputs inner, so 8 int16 sums stay in registers across the groups, then the scales and
// offsets. tile_block_i4 (outputs outer) touches lines 0, 4, 8, 12, 16, 18, then 1, 5, ... of each block, a
// pattern that hardware prefetchers follow poorly: on Zen 4 it streamed 19 GB/s without software prefetch and
// 27-29 with it, this one 32 (its bus) without; in L2 it computes at ~56 GB/s against ~45 (fewer broadcasts).
// ahead: the blocks of software prefetch ahead of the stream (0: the hardware prefetchers alone).
inline void i4_row_block(const QuantRows& xr, int64_t K, const uint8_t* __restrict tile, int64_t b,
                         float* __restrict acc_io, bool first, int64_t ahead) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  if (first) std::memset(acc_io, 0, sizeof(float) * TN);
  const uint8_t* w = tile + b * I4_BLOCK;
  const uint8_t* sz = w + QB * TN / 2;
  if (ahead > 0)
    for (int l = 0; l < I4_BLOCK / 64; l++)
      _mm_prefetch(reinterpret_cast<const char*>(w + ahead * I4_BLOCK + l * 64), _MM_HINT_T0);
  __m256i dot[TN / 8];
#pragma GCC unroll 8
  for (int h = 0; h < TN / 8; h++) dot[h] = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int g = 0; g < 4; g++) {
    int32_t q0, q1;  // x's quads k 8g..8g+3 and 8g+4..8g+7
    std::memcpy(&q0, xr.q.data() + b * QB + 8 * g, 4);
    std::memcpy(&q1, xr.q.data() + b * QB + 8 * g + 4, 4);
    const __m256i x0 = _mm256_set1_epi32(q0), x1 = _mm256_set1_epi32(q1);
#pragma GCC unroll 8
    for (int h = 0; h < TN / 8; h++) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 4 * TN + h * 32));
      const __m256i lo = _mm256_and_si256(raw, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
      dot[h] = _mm256_add_epi16(dot[h], _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1)));
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 a = _mm256_set1_ps(xr.scale[b]), qsum = _mm256_set1_ps(xr.bias[b] / -128.f);
#pragma GCC unroll 8
  for (int h = 0; h < TN / 8; h++) {  // as tile_block_i4 rounds it, so one row and many give the same bits
    const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sz + h * 16)));
    const __m256 z = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sz + 2 * TN + h * 16)));
    const __m256 d = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(dot[h], ones)), s);
    float* o = acc_io + h * 8;
    _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_fmadd_ps(z, qsum, d), a, _mm256_loadu_ps(o)));
  }
}

// acc0 / acc1 = x[0] . int4 tile0 / tile1 (all K / QB blocks), taking a block of each in turn: two streams
// (on Zen 3, ~85% of the bus against ~78% for one, same shape; on Zen 4, 32 GB/s against 28-29)
void i4_row_two_tiles(const QuantRows& xr, int64_t K, const uint8_t* tile0, const uint8_t* tile1, float* acc0,
                      float* acc1, int64_t ahead) {
  for (int64_t b = 0; b < K / QB; b++) {
    i4_row_block(xr, K, tile0, b, acc0, b == 0, ahead);
    i4_row_block(xr, K, tile1, b, acc1, b == 0, ahead);
  }
}
