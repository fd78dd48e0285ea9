// avx2 tier, GEMM tiles: AVX2 + FMA + F16C (Zen 1-3, Haswell and later); included by kernels.cpp.
//
// bf16: a 32-bit lane of the pair layout holds (even k, odd k) of one output, so a shift by 16 (even) and a
// mask (odd) widen it to two fp32 vectors of 8 outputs, FMA'd against broadcast x. int8/int4: vpmaddubsw
// (unsigned x signed bytes, adjacent products summed to int16) then vpmaddwd by ones (int16 pairs to int32).
// vpmaddubsw saturates at 32767: int4 codes are <= 15 so 15 * 127 * 2 per pair and four such k groups summed
// in int16 stay below it; int8 weights take the sign trick, |w| times x with w's sign, <= 127 * 127 * 2.

// rows per register tile: a 1-row tile keeps all 64 outputs (8 accumulators) in registers; 2 rows take the
// tile in two halves of 32 outputs (4 x 2 accumulators + 4 broadcasts), in turn over chunks of 32 pair rows
// (bf16_rows), so the second half reads from L1.
constexpr int MAXMB_BF16 = 2;
// k pairs per block when x has more rows than one register tile: 32 pair rows (8 KB of a tile) stay in L1 while
// every register tile of rows passes over them (with KBLOCK's 256 KB, each tile after the first read them from
// L2: 3 rows cost 2.5x one row, 4 rows 2.9x; now 1.4-1.6x and 1.7-2.0x, 1536 x 4096 on Zen 4)
constexpr int64_t KBLOCK_BF16 = 32;
constexpr int MAXMB_Q = 3;  // quantized kernels keep their fp32 sums in memory (L1) and only int16 sums in registers
constexpr int MAXMB_I4 = MAXMB_Q;

// Software prefetch distance in bytes ahead of the weight stream. One core of Zen 3 streams ~80% of its bus
// with the hardware prefetchers alone and ~90% with this; the quantized loops, whose reads jump within a
// block, stream ~30% without it and ~80% with it (measured, 1 x 1536 by 1536 x 8960). Two blocks ahead was
// best (one or three: a few points less).
// One bf16 row is read by a plan set at run time (g_streams_bf16, g_prefetch_bf16; stream_tune.py measures it
// per CPU): Zen 3 was fastest with two streams and 512 bytes ahead; on Zen 4 that prefetch cut the rate to
// 17 GB/s, the two-pass chunks of two streams left it at ~25, and one stream with none reads ~31 (its bus), so
// no one constant serves both.
constexpr int64_t PREFETCH_I8 = 2 * QB * TN, PREFETCH_I4 = 2 * I4_BLOCK;

// acc (fp32 [MB, 64], row stride 64), outputs 8 V0 .. 8 (V0 + NV) += x[0:MB, 2*p0 : 2*p1] . tile pairs p0..p1
template <int MB, int V0, int NV>
inline void tile_block(const bf16* __restrict x, int64_t ldx, const bf16* __restrict tile, int64_t p0, int64_t p1,
                       float* __restrict acc_io, bool first) {
  __m256 acc[NV][MB];
#pragma GCC unroll 8
  for (int v = 0; v < NV; v++)
#pragma GCC unroll 2
    for (int m = 0; m < MB; m++)
      acc[v][m] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_io + m * TN + (V0 + v) * 8);
  const __m256i high = _mm256_set1_epi32((int)0xffff0000);
  const bf16* w = tile + p0 * TN * 2 + V0 * 16;
  const int64_t ahead = g_prefetch_bf16 / 2;  // in bf16 elements
#pragma GCC unroll 1
  for (int64_t p = p0; p < p1; p++, w += TN * 2) {
    if constexpr (V0 == 0)  // a pair row is 4 cache lines; the V0 > 0 pass reads them again from L1/L2
      if (ahead > 0)
        for (int l = 0; l < 4; l++) _mm_prefetch(reinterpret_cast<const char*>(w + ahead + 32 * l), _MM_HINT_T0);
    __m256 xe[MB], xo[MB];
#pragma GCC unroll 2
    for (int m = 0; m < MB; m++) {  // the pair broadcast once, widened as the weights are
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * p, 4);
      const __m256i xp = _mm256_set1_epi32(pair);
      xe[m] = _mm256_castsi256_ps(_mm256_slli_epi32(xp, 16));
      xo[m] = _mm256_castsi256_ps(_mm256_and_si256(xp, high));
    }
#pragma GCC unroll 8
    for (int v = 0; v < NV; v++) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + v * 16));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
#pragma GCC unroll 2
      for (int m = 0; m < MB; m++) acc[v][m] = _mm256_fmadd_ps(odd, xo[m], _mm256_fmadd_ps(even, xe[m], acc[v][m]));
    }
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; v++)
#pragma GCC unroll 2
    for (int m = 0; m < MB; m++) _mm256_storeu_ps(acc_io + m * TN + (V0 + v) * 8, acc[v][m]);
}

// One row against two tiles at once, 32 outputs of each per pass (4 accumulators per tile). The gemm pairs
// tile t with tile t + T/2, so the weights are read as two long streams: one core keeps more reads in flight
// over two streams than over one (measured on Zen 3: ~97% of its bus against ~87% for one stream; not so on
// Zen 4, where the plan picks one stream: tile_block<1, 0, 8>). Each
// chunk of pairs is taken in two passes, the first prefetching the whole pair rows, the second reading them
// from L1.
template <int V0>
inline void two_tiles_pass(const bf16* __restrict x, const bf16* __restrict tile0, const bf16* __restrict tile1,
                           int64_t p0, int64_t p1, __m256 (&acc)[2][8]) {
  const __m256i high = _mm256_set1_epi32((int)0xffff0000);
  __m256 a0[4], a1[4];
  for (int v = 0; v < 4; v++) {
    a0[v] = acc[0][V0 + v];
    a1[v] = acc[1][V0 + v];
  }
  const bf16* w0 = tile0 + p0 * TN * 2 + V0 * 16;
  const bf16* w1 = tile1 + p0 * TN * 2 + V0 * 16;
  const int64_t ahead = g_prefetch_bf16 / 2;
#pragma GCC unroll 1
  for (int64_t p = p0; p < p1; p++, w0 += TN * 2, w1 += TN * 2) {
    if constexpr (V0 == 0)
      if (ahead > 0)
        for (int l = 0; l < 4; l++) {
          _mm_prefetch(reinterpret_cast<const char*>(w0 + ahead + 32 * l), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(w1 + ahead + 32 * l), _MM_HINT_T0);
        }
    const __m256 xe = _mm256_set1_ps(float(x[2 * p])), xo = _mm256_set1_ps(float(x[2 * p + 1]));
#pragma GCC unroll 4
    for (int v = 0; v < 4; v++) {
      const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + v * 16));
      a0[v] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(r0, high)), xo,
                              _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(r0, 16)), xe, a0[v]));
      const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1 + v * 16));
      a1[v] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(r1, high)), xo,
                              _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(r1, 16)), xe, a1[v]));
    }
  }
  for (int v = 0; v < 4; v++) {
    acc[0][V0 + v] = a0[v];
    acc[1][V0 + v] = a1[v];
  }
}

// acc0 / acc1 (fp32 [64]) = x[0, 0:2P] . tile0 / tile1 (all P pairs)
void bf16_row_two_tiles(const bf16* x, const bf16* tile0, const bf16* tile1, int64_t P, float* acc0, float* acc1) {
  constexpr int64_t CHUNK = 32;  // 2 x 32 pair rows of 256 bytes: 16 KB, still in L1 for the second pass
  __m256 acc[2][8];
  for (int v = 0; v < 8; v++) acc[0][v] = acc[1][v] = _mm256_setzero_ps();
  for (int64_t c = 0; c < P; c += CHUNK) {
    const int64_t e = std::min(P, c + CHUNK);
    two_tiles_pass<0>(x, tile0, tile1, c, e, acc);
    two_tiles_pass<4>(x, tile0, tile1, c, e, acc);
  }
  for (int v = 0; v < 8; v++) {
    _mm256_storeu_ps(acc0 + v * 8, acc[0][v]);
    _mm256_storeu_ps(acc1 + v * 8, acc[1][v]);
  }
}

void bf16_rows(int mb, const bf16* x, int64_t ldx, const bf16* tile, int64_t p0, int64_t p1, float* acc, bool first) {
  if (mb == 1) return tile_block<1, 0, 8>(x, ldx, tile, p0, p1, acc, first);
  // Two rows take the tile's two halves in turn over chunks of KBLOCK_BF16 pair rows: the second half reads the
  // lines the first brought into L1. One half over the whole range, then the other, left the second to read
  // from L2 or memory, and cost 1.9-2.1x one row (1536 x 4096, Zen 4). A row's sums run over k in the same
  // order either way, so its bits do not change.
  for (int64_t c = p0; c < p1; c += KBLOCK_BF16) {
    const int64_t e = std::min(p1, c + KBLOCK_BF16);
    tile_block<2, 0, 4>(x, ldx, tile, c, e, acc, first && c == p0);
    tile_block<2, 4, 4>(x, ldx, tile, c, e, acc, first && c == p0);
  }
}

// The activation quads of rows m0..m0+MB in block b, broadcast: xb[m][i] holds k 4i..4i+3 of the block.
template <int MB>
inline void broadcast_quads(__m256i (&xb)[MB][QB / 4], const QuantRows& xr, int64_t m0, int64_t K, int64_t b) {
  for (int m = 0; m < MB; m++)
    for (int64_t i = 0; i < QB / 4; i++) {
      int32_t quad;
      std::memcpy(&quad, xr.q.data() + (m0 + m) * K + b * QB + 4 * i, 4);
      xb[m][i] = _mm256_set1_epi32(quad);
    }
}

template <int MB>
inline void zero_rows(float* acc_io, bool first) {
  if (first) std::memset(acc_io, 0, sizeof(float) * MB * TN);
}

// acc (fp32 [MB, 64]) += dequantized x[0:MB, blocks b0..b1] . int8 tile (the per-output scales come after)
template <int MB>
inline void tile_block_i8(const QuantRows& xr, int64_t m0, int64_t K, const uint8_t* __restrict tile, int64_t b0,
                          int64_t b1, float* __restrict acc_io, bool first) {
  const int64_t nb = K / QB;
  const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
  zero_rows<MB>(acc_io, first);
  for (int64_t b = b0; b < b1; b++) {
    __m256i xb[MB][QB / 4];
    broadcast_quads<MB>(xb, xr, m0, K, b);
    const uint8_t* w = tile + b * QB * TN;
    __m256 a[MB];
    for (int m = 0; m < MB; m++) a[m] = _mm256_set1_ps(xr.scale[(m0 + m) * nb + b]);
    for (int64_t h = 0; h < TN / 8; h++) {  // outputs 8h..8h+7
      for (int l = 0; l < 4; l++)  // 8 x 4 lines: the 2 KB of a block ahead
        _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_I8 + h * QB * TN / 8 + l * 64), _MM_HINT_T0);
      __m256i dot[MB];
#pragma GCC unroll 3
      for (int m = 0; m < MB; m++) dot[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int64_t p = 0; p < QB / 4; p++) {
        // code - 128 as a signed byte, its magnitude, and x with its sign
        const __m256i ws = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * TN * 4 + h * 32)), flip);
        const __m256i aw = _mm256_abs_epi8(ws);
#pragma GCC unroll 3
        for (int m = 0; m < MB; m++)
          dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xb[m][p], ws)), ones));
      }
#pragma GCC unroll 3
      for (int m = 0; m < MB; m++) {
        float* o = acc_io + m * TN + h * 8;
        _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]), a[m], _mm256_loadu_ps(o)));
      }
    }
  }
}

// acc += dequantized x[0:MB, blocks b0..b1] . int4 tile: a (s sum(q q_x) + z sum(q_x)) per block
template <int MB>
inline void tile_block_i4(const QuantRows& xr, int64_t m0, int64_t K, const uint8_t* __restrict tile, int64_t b0,
                          int64_t b1, float* __restrict acc_io, bool first) {
  const int64_t nb = K / QB;
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  zero_rows<MB>(acc_io, first);
  for (int64_t b = b0; b < b1; b++) {
    __m256i xb[MB][QB / 4];
    broadcast_quads<MB>(xb, xr, m0, K, b);
    const uint8_t* w = tile + b * I4_BLOCK;
    const uint8_t* sz = w + QB * TN / 2;
    float a[MB], qsum[MB];  // hoisted: the compiler cannot, acc_io might alias xr
    for (int m = 0; m < MB; m++) {
      a[m] = xr.scale[(m0 + m) * nb + b];
      qsum[m] = xr.bias[(m0 + m) * nb + b] / -128.f;
    }
    for (int64_t h = 0; h < TN / 8; h++) {  // outputs 8h..8h+7: half h % 2 of code vector h / 2
      for (int l = 0; l < 3; l++)  // 8 x 3 lines cover the I4_BLOCK (20 lines) of a block ahead
        _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_I4 + h * I4_BLOCK / 8 + l * 64), _MM_HINT_T0);
      __m256i dot[MB];
#pragma GCC unroll 3
      for (int m = 0; m < MB; m++) dot[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int64_t g = 0; g < 4; g++) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 4 * TN + h * 32));
        const __m256i lo = _mm256_and_si256(raw, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
#pragma GCC unroll 3
        for (int m = 0; m < MB; m++)
          dot[m] = _mm256_add_epi16(dot[m], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xb[m][2 * g]),
                                                             _mm256_maddubs_epi16(hi, xb[m][2 * g + 1])));
      }
      const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sz + h * 16)));
      const __m256 z = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sz + 2 * TN + h * 16)));
#pragma GCC unroll 3
      for (int m = 0; m < MB; m++) {
        float* o = acc_io + m * TN + h * 8;
        const __m256 d = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(dot[m], ones)), s);
        _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_fmadd_ps(z, _mm256_set1_ps(qsum[m]), d), _mm256_set1_ps(a[m]),
                                            _mm256_loadu_ps(o)));
      }
    }
  }
}

#include "row_i4_avx2.h"  // one row of int4 weights as two streams (the avx512 tier runs it too)

// One row's block b of an int8 tile in address order, as i4_row_block: quad row p (k 4p..4p+3 of all 64
// outputs) outer, outputs inner, 8 int32 sums in registers; rounded as tile_block_i8 rounds (same bits).
inline void i8_row_block(const QuantRows& xr, int64_t K, const uint8_t* __restrict tile, int64_t b,
                         float* __restrict acc_io, bool first) {
  const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
  if (first) std::memset(acc_io, 0, sizeof(float) * TN);
  const uint8_t* w = tile + b * QB * TN;
  if (g_prefetch_blocks > 0)
    for (int l = 0; l < QB * TN / 64; l++)
      _mm_prefetch(reinterpret_cast<const char*>(w + g_prefetch_blocks * QB * TN + l * 64), _MM_HINT_T0);
  __m256i dot[TN / 8];
#pragma GCC unroll 8
  for (int h = 0; h < TN / 8; h++) dot[h] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int64_t p = 0; p < QB / 4; p++) {
    int32_t quad;
    std::memcpy(&quad, xr.q.data() + b * QB + 4 * p, 4);
    const __m256i xq = _mm256_set1_epi32(quad);
#pragma GCC unroll 8
    for (int h = 0; h < TN / 8; h++) {
      const __m256i ws = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * TN * 4 + h * 32)), flip);
      dot[h] = _mm256_add_epi32(dot[h], _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(ws), _mm256_sign_epi8(xq, ws)), ones));
    }
  }
  const __m256 a = _mm256_set1_ps(xr.scale[b]);
#pragma GCC unroll 8
  for (int h = 0; h < TN / 8; h++) {
    float* o = acc_io + h * 8;
    _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h]), a, _mm256_loadu_ps(o)));
  }
}

// acc0 / acc1 = x[0] . int8 tile0 / tile1 (all K / QB blocks, then the per-output scales), a block of each in turn
void i8_row_two_tiles(const QuantRows& xr, int64_t K, const uint8_t* tile0, const uint8_t* tile1, float* acc0,
                      float* acc1) {
  for (int64_t b = 0; b < K / QB; b++) {
    i8_row_block(xr, K, tile0, b, acc0, b == 0);
    i8_row_block(xr, K, tile1, b, acc1, b == 0);
  }
  const float* s0 = reinterpret_cast<const float*>(tile0 + K * TN);
  const float* s1 = reinterpret_cast<const float*>(tile1 + K * TN);
  for (int64_t j = 0; j < TN; j++) {
    acc0[j] *= s0[j];
    acc1[j] *= s1[j];
  }
}

#define SAGUARO_ROW_TWO_TILES  // one row as two streams (kernels.cpp's row_two_tiles), for every format here
inline bool two_streams(bool int4, bool int8) { return int4 || int8 || g_streams_bf16 == 2; }

// One row against tiles a and b, a chunk of each in turn
inline void row_pair(bool int4, bool int8, const bf16* x, const QuantRows& xr, int64_t K, const uint8_t* a,
                     const uint8_t* b, float* acc0, float* acc1) {
  if (int4)
    i4_row_two_tiles(xr, K, a, b, acc0, acc1, g_prefetch_blocks);
  else if (int8)
    i8_row_two_tiles(xr, K, a, b, acc0, acc1);
  else
    bf16_row_two_tiles(x, reinterpret_cast<const bf16*>(a), reinterpret_cast<const bf16*>(b), K / 2, acc0, acc1);
}

QuantRows quantize_rows(const bf16* x, int64_t ldx, int64_t M, int64_t K) { return quantize_rows_scalar(x, ldx, M, K); }
