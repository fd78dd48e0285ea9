// avx512 tier, GEMM tiles (AVX512-BF16 and AVX512-VNNI: Zen 4, Sapphire Rapids and later); included by kernels.cpp.
//
// bf16: fp32 accumulation with vdpbf16ps; several rows (verification, batches, tree branches) reuse each
// loaded weight vector, so 3-6 rows cost about what 1 row does. int8/int4: activations quantized per block
// of 32 (quantize_rows), multiplied with vpdpbusd (64 multiply-adds per instruction, unsigned weight bytes x
// signed activation bytes).

constexpr int MAXMB_BF16 = 6;  // rows per register tile: 4 x 6 accumulators + 4 weights + 1 broadcast
constexpr int64_t KBLOCK_BF16 = KBLOCK;  // k pairs per block past one register tile of rows
// rows per register tile of the quantized kernels: 4 x 3 int32 + 4 x 3 fp32 accumulators (measured for int4:
// 16-output strips of 4-6 rows were 15-35% slower)
constexpr int MAXMB_Q = 3;
// int4 takes 4 rows in one pass of its own kernel (tile_block_i4_wide), where two tiles of 2 rows read and
// unpacked the weights twice (Zen 4, 1536 x 8960: 0.43 ms against 0.50; one row 0.26). 5 and 6 rows in one
// pass measured no faster than 3 + 2 and 3 + 3, whose sums all stay in registers
constexpr int MAXMB_I4 = 4;

template <int MB>
inline void tile_block(const bf16* __restrict x, int64_t ldx, const bf16* __restrict tile, int64_t p0, int64_t p1,
                       float* __restrict acc_io, bool first) {
  __m512 acc[4][MB];
#pragma GCC unroll 4
  for (int v = 0; v < 4; v++)
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++) acc[v][m] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_io + m * TN + v * 16);
  const bf16* w = tile + p0 * TN * 2;
#pragma GCC unroll 1
  for (int64_t p = p0; p < p1; p++, w += TN * 2) {
    __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64);
    __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 96);
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * p, 4);
      __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      acc[0][m] = _mm512_dpbf16_ps(acc[0][m], w0, xb);
      acc[1][m] = _mm512_dpbf16_ps(acc[1][m], w1, xb);
      acc[2][m] = _mm512_dpbf16_ps(acc[2][m], w2, xb);
      acc[3][m] = _mm512_dpbf16_ps(acc[3][m], w3, xb);
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < 4; v++)
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++) _mm512_storeu_ps(acc_io + m * TN + v * 16, acc[v][m]);
}

void bf16_rows(int mb, const bf16* x, int64_t ldx, const bf16* tile, int64_t p0, int64_t p1, float* acc, bool first) {
  with_rows<MAXMB_BF16>(mb, [&](auto rows) { tile_block<decltype(rows)::value>(x, ldx, tile, p0, p1, acc, first); });
}

QuantRows quantize_rows(const bf16* x, int64_t ldx, int64_t M, int64_t K) {
  const int64_t nb = K / QB;
  QuantRows r{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<int32_t>(M * nb)};
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t m = 0; m < M; m++)
    for (int64_t b = 0; b < nb; b++) {
      // 32 bf16 values as two fp32 vectors (bf16 is the top half of an fp32)
      const bf16* src = x + m * ldx + b * QB;
      const __m512i raw = _mm512_loadu_si512(src);
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32((int)0xffff0000)));
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, sign), _mm512_and_ps(hi, sign)));
      const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      // round to nearest even, as nearbyint (the default MXCSR mode)
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
      // lo holds the even elements, hi the odd ones: interleave back to source order
      const __m128i even = _mm512_cvtepi32_epi8(qlo), odd = _mm512_cvtepi32_epi8(qhi);
      int8_t* dst = r.q.data() + m * K + b * QB;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_unpacklo_epi8(even, odd));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm_unpackhi_epi8(even, odd));
      r.scale[m * nb + b] = s;
      r.bias[m * nb + b] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    }
  return r;
}

// Quantizing packers start from the bf16 layout (so rows land where `pack` puts them, SwiGLU included):

template <int MB>
inline void load_tile(__m512 (&facc)[4][MB], const float* acc_io, bool first) {
#pragma GCC unroll 4
  for (int v = 0; v < 4; v++)
#pragma GCC unroll 4
    for (int m = 0; m < MB; m++) facc[v][m] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_io + m * TN + v * 16);
}

template <int MB>
inline void store_tile(const __m512 (&facc)[4][MB], float* acc_io) {
#pragma GCC unroll 4
  for (int v = 0; v < 4; v++)
#pragma GCC unroll 4
    for (int m = 0; m < MB; m++) _mm512_storeu_ps(acc_io + m * TN + v * 16, facc[v][m]);
}

// int8 (layout: quant_pack.h): sum((q_w + 128) q_x) - 128 sum(q_x) = sum(q_w q_x) per block, the correction
// being QuantRows::bias.
template <int MB>
inline void tile_block_i8(const QuantRows& xr, int64_t m0, int64_t K, const uint8_t* __restrict tile, int64_t b0,
                          int64_t b1, float* __restrict acc_io, bool first) {
  const int64_t nb = K / QB;
  __m512 facc[4][MB];
  load_tile<MB>(facc, acc_io, first);
  for (int64_t b = b0; b < b1; b++) {
    __m512i acc[4][MB];
#pragma GCC unroll 4
    for (int m = 0; m < MB; m++) {
      const __m512i init = _mm512_set1_epi32(xr.bias[(m0 + m) * nb + b]);
#pragma GCC unroll 4
      for (int v = 0; v < 4; v++) acc[v][m] = init;
    }
    const uint8_t* w = tile + b * (QB / 4) * TN * 4;
#pragma GCC unroll 8
    for (int64_t p = 0; p < QB / 4; p++, w += TN * 4) {
      const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
      const __m512i w2 = _mm512_loadu_si512(w + 128), w3 = _mm512_loadu_si512(w + 192);
#pragma GCC unroll 4
      for (int m = 0; m < MB; m++) {
        int32_t quad;
        std::memcpy(&quad, xr.q.data() + (m0 + m) * K + b * QB + 4 * p, 4);
        const __m512i xb = _mm512_set1_epi32(quad);
        acc[0][m] = _mm512_dpbusd_epi32(acc[0][m], w0, xb);
        acc[1][m] = _mm512_dpbusd_epi32(acc[1][m], w1, xb);
        acc[2][m] = _mm512_dpbusd_epi32(acc[2][m], w2, xb);
        acc[3][m] = _mm512_dpbusd_epi32(acc[3][m], w3, xb);
      }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MB; m++) {
      const __m512 s = _mm512_set1_ps(xr.scale[(m0 + m) * nb + b]);
#pragma GCC unroll 4
      for (int v = 0; v < 4; v++) facc[v][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[v][m]), s, facc[v][m]);
    }
  }
  store_tile<MB>(facc, acc_io);
}

// int4 (layout: quant_pack.h): the low and high nibbles of a code vector are two vpdpbusd weight operands.

template <int MB>
inline void zero_sums(__m512i (&acc)[4][MB]) {
#pragma GCC unroll 4
  for (int v = 0; v < 4; v++)
#pragma GCC unroll 4
    for (int m = 0; m < MB; m++) acc[v][m] = _mm512_setzero_si512();
}

// The scales and offsets of outputs 16v..16v+15 in the block at w; add() puts one row's int32 sums of the block
// into its fp32 sums f: f + a (z sum(q_x) + s sum(q q_x)), the same operations in the same order in every
// kernel, so a row's bits do not depend on which kernel ran it.
struct I4Scales {
  __m512 s, z;
  I4Scales(const uint8_t* w, int v) {
    const uint8_t* sz = w + QB * TN / 2;
    s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + v * 32)));
    z = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + 2 * TN + v * 32)));
  }
  __m512 add(__m512 f, __m512i sums, const QuantRows& xr, int64_t row_block) const {
    const float a = xr.scale[row_block], qsum = xr.bias[row_block] / -128.f;
    const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(sums), s);
    return _mm512_fmadd_ps(_mm512_fmadd_ps(z, _mm512_set1_ps(qsum), dot), _mm512_set1_ps(a), f);
  }
};

template <int MB>
inline void tile_block_i4(const QuantRows& xr, int64_t m0, int64_t K, const uint8_t* __restrict tile, int64_t b0,
                          int64_t b1, float* __restrict acc_io, bool first) {
  const int64_t nb = K / QB;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 facc[4][MB];
  load_tile<MB>(facc, acc_io, first);
  for (int64_t b = b0; b < b1; b++) {
    const uint8_t* w = tile + b * I4_BLOCK;
    __m512i acc[4][MB];
    zero_sums<MB>(acc);
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) {
      __m512i xlo[MB], xhi[MB];
#pragma GCC unroll 4
      for (int m = 0; m < MB; m++) {
        int32_t quad[2];
        std::memcpy(quad, xr.q.data() + (m0 + m) * K + b * QB + 8 * g, 8);
        xlo[m] = _mm512_set1_epi32(quad[0]);
        xhi[m] = _mm512_set1_epi32(quad[1]);
      }
#pragma GCC unroll 4
      for (int v = 0; v < 4; v++) {
        const __m512i raw = _mm512_loadu_si512(w + g * 4 * TN + v * 64);
        const __m512i lo = _mm512_and_si512(raw, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
#pragma GCC unroll 4
        for (int m = 0; m < MB; m++) acc[v][m] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[v][m], lo, xlo[m]), hi, xhi[m]);
      }
    }
#pragma GCC unroll 4
    for (int v = 0; v < 4; v++) {
      const I4Scales sz(w, v);
#pragma GCC unroll 4
      for (int m = 0; m < MB; m++) facc[v][m] = sz.add(facc[v][m], acc[v][m], xr, (m0 + m) * nb + b);
    }
  }
  store_tile<MB>(facc, acc_io);
}

// acc + vpdpbusd(w, the 4 bytes at x broadcast), the broadcast left a memory operand: written with the
// intrinsics, GCC hoists all 2 x MB broadcasts of a k group into registers and spills the sums
inline __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int8_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}

// MB = 4 rows: the 4 x MB int32 sums take 16 registers, so the fp32 sums stay in acc_io (L1) and x's quads are
// broadcast from memory (vpdpbusd's m32bcst operand). Each value's arithmetic is tile_block_i4's, in the
// same order, so a row's bits do not depend on the rows beside it. Not inlined: inlined into gemm beside the
// register tiles, it made their 2-row case 20% slower.
template <int MB>
__attribute__((noinline)) void tile_block_i4_wide(const QuantRows& xr, int64_t m0, int64_t K,
                                                  const uint8_t* __restrict tile, int64_t b0, int64_t b1,
                                                  float* __restrict acc_io, bool first) {
  const int64_t nb = K / QB;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  if (first)
    for (int64_t i = 0; i < MB * TN; i += 16) _mm512_storeu_ps(acc_io + i, _mm512_setzero_ps());
  for (int64_t b = b0; b < b1; b++) {
    const uint8_t* w = tile + b * I4_BLOCK;
    const int8_t* xq = xr.q.data() + m0 * K + b * QB;
    __m512i acc[4][MB];
    zero_sums<MB>(acc);
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) {
#pragma GCC unroll 4
      for (int v = 0; v < 4; v++) {
        const __m512i raw = _mm512_loadu_si512(w + g * 4 * TN + v * 64);
        const __m512i lo = _mm512_and_si512(raw, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
#pragma GCC unroll 4
        for (int m = 0; m < MB; m++)
          acc[v][m] = dpbusd_broadcast(dpbusd_broadcast(acc[v][m], lo, xq + m * K + 8 * g), hi, xq + m * K + 8 * g + 4);
      }
    }
#pragma GCC unroll 4
    for (int v = 0; v < 4; v++) {
      const I4Scales sz(w, v);
#pragma GCC unroll 4
      for (int m = 0; m < MB; m++) {
        float* f = acc_io + m * TN + v * 16;
        _mm512_storeu_ps(f, sz.add(_mm512_loadu_ps(f), acc[v][m], xr, (m0 + m) * nb + b));
      }
    }
  }
}

// One int4 row as two streams (kernels.cpp's row_two_tiles) through the avx2 row kernel (row_i4_avx2.h): on Zen 4
// it read the draft's 24 gate/up matrices (9728 x 896) at 34 GB/s where tile_block_i4 read 27. The same bits.
#include "row_i4_avx2.h"
#define SAGUARO_ROW_TWO_TILES
inline bool two_streams(bool int4, bool /*int8*/) { return int4; }
inline void row_pair(bool /*int4*/, bool /*int8*/, const bf16* /*x*/, const QuantRows& xr, int64_t K,
                     const uint8_t* a, const uint8_t* b, float* acc0, float* acc1) {
  i4_row_two_tiles(xr, K, a, b, acc0, acc1, 0);  // the hardware prefetchers alone (Zen 4 and later)
}
