// portable tier, GEMM tiles: plain C++ that the compiler vectorizes for whatever the target has (SSE2 on any
// x86-64, NEON on aarch64); included by kernels.cpp. Each packed k step is first widened into fp32 / int32
// arrays that stay in L1, then applied to every row with loops over the 64 outputs of the tile.

constexpr int MAXMB_BF16 = 4;
constexpr int64_t KBLOCK_BF16 = KBLOCK;  // k pairs per block past one register tile of rows
constexpr int MAXMB_Q = 4;
constexpr int MAXMB_I4 = MAXMB_Q;

template <int MB>
inline void load_rows(float (&acc)[MB][TN], const float* acc_io, bool first) {
  for (int m = 0; m < MB; m++)
    for (int64_t j = 0; j < TN; j++) acc[m][j] = first ? 0.f : acc_io[m * TN + j];
}

template <int MB>
inline void store_rows(const float (&acc)[MB][TN], float* acc_io) {
  for (int m = 0; m < MB; m++)
    for (int64_t j = 0; j < TN; j++) acc_io[m * TN + j] = acc[m][j];
}

// acc (fp32 [MB, 64], row stride 64) += x[0:MB, 2*p0 : 2*p1] . tile pairs p0..p1 (bf16 layout: kernels.cpp)
template <int MB>
inline void tile_block(const bf16* __restrict x, int64_t ldx, const bf16* __restrict tile, int64_t p0, int64_t p1,
                       float* __restrict acc_io, bool first) {
  float acc[MB][TN], even[TN], odd[TN];
  load_rows<MB>(acc, acc_io, first);
  const uint32_t* w = reinterpret_cast<const uint32_t*>(tile) + p0 * TN;
  for (int64_t p = p0; p < p1; p++, w += TN) {
    for (int64_t j = 0; j < TN; j++) {  // a pair's low half is the even k
      even[j] = f32_bits(w[j] << 16);
      odd[j] = f32_bits(w[j] & 0xffff0000u);
    }
    for (int m = 0; m < MB; m++) {
      const float xe = float(x[m * ldx + 2 * p]), xo = float(x[m * ldx + 2 * p + 1]);
      for (int64_t j = 0; j < TN; j++) acc[m][j] += even[j] * xe + odd[j] * xo;
    }
  }
  store_rows<MB>(acc, acc_io);
}

// acc += dequantized x[0:MB, blocks b0..b1] . int8 tile (w = code - 128; the per-output scales come after)
template <int MB>
inline void tile_block_i8(const QuantRows& xr, int64_t m0, int64_t K, const uint8_t* __restrict tile, int64_t b0,
                          int64_t b1, float* __restrict acc_io, bool first) {
  const int64_t nb = K / QB;
  float acc[MB][TN];
  int32_t w[QB][TN];
  load_rows<MB>(acc, acc_io, first);
  for (int64_t b = b0; b < b1; b++) {
    const uint8_t* src = tile + b * QB * TN;
    for (int64_t k = 0; k < QB; k++)
      for (int64_t j = 0; j < TN; j++) w[k][j] = (int32_t)src[((k / 4) * TN + j) * 4 + k % 4] - 128;
    for (int m = 0; m < MB; m++) {
      const int8_t* xq = xr.q.data() + (m0 + m) * K + b * QB;
      int32_t dot[TN] = {};
      for (int64_t k = 0; k < QB; k++)
        for (int64_t j = 0; j < TN; j++) dot[j] += w[k][j] * xq[k];
      const float a = xr.scale[(m0 + m) * nb + b];
      for (int64_t j = 0; j < TN; j++) acc[m][j] += (float)dot[j] * a;
    }
  }
  store_rows<MB>(acc, acc_io);
}

// fp16 bits to fp32 (every finite value, subnormals included) in integer and float arithmetic without
// branches, so that a loop of them vectorizes: |v| = (mantissa + 1024 [normal]) * 2^(max(e, 1) - 25).
inline float half_to_float(uint16_t h) {
  const uint32_t e = (h >> 10) & 31, m = h & 1023u, normal = e > 0;
  const float scale = f32_bits(((e | (normal ^ 1u)) + 102u) << 23);  // 2^(max(e, 1) - 25)
  const float v = (float)(m | (normal << 10)) * scale;
  return f32_bits((uint32_t)(h & 0x8000u) << 16 | bits_f32(v));
}

// acc += dequantized x[0:MB, blocks b0..b1] . int4 tile: a (s sum(q q_x) + z sum(q_x)) per block. Group g's
// 256 code bytes are [64 outputs][4 k] (quant_pack.h): the codes are widened to int16 in memory order and each
// row's products summed per (output, k mod 4) in int16, so every loop is contiguous with a 4-periodic x and
// vectorizes (SSE2, NEON). int16 holds the sums: 8 products of |q q_x| <= 15 * 127 per (output, k mod 4).
template <int MB>
inline void tile_block_i4(const QuantRows& xr, int64_t m0, int64_t K, const uint8_t* __restrict tile, int64_t b0,
                          int64_t b1, float* __restrict acc_io, bool first) {
  const int64_t nb = K / QB;
  float acc[MB][TN], s[TN], z[TN];
  int16_t lo[4][4 * TN], hi[4][4 * TN], dot[4 * TN];
  load_rows<MB>(acc, acc_io, first);
  for (int64_t b = b0; b < b1; b++) {
    const uint8_t* w = tile + b * I4_BLOCK;
    for (int64_t g = 0; g < 4; g++)  // byte 4j + i of group g: output j at k = 8g + i (low) and 8g + 4 + i (high)
      for (int64_t c = 0; c < 4 * TN; c++) {
        lo[g][c] = (int16_t)(w[g * 4 * TN + c] & 15);
        hi[g][c] = (int16_t)(w[g * 4 * TN + c] >> 4);
      }
    const uint16_t* sz = reinterpret_cast<const uint16_t*>(w + QB * TN / 2);  // fp16 bits
    for (int64_t j = 0; j < TN; j++) {
      s[j] = half_to_float(sz[j]);
      z[j] = half_to_float(sz[TN + j]);
    }
    for (int m = 0; m < MB; m++) {
      const int8_t* xq = xr.q.data() + (m0 + m) * K + b * QB;
      for (int64_t c = 0; c < 4 * TN; c++) dot[c] = 0;
      for (int64_t g = 0; g < 4; g++) {
        const int16_t x0[4] = {xq[8 * g], xq[8 * g + 1], xq[8 * g + 2], xq[8 * g + 3]};
        const int16_t x1[4] = {xq[8 * g + 4], xq[8 * g + 5], xq[8 * g + 6], xq[8 * g + 7]};
        for (int64_t j = 0; j < TN; j++)
          for (int64_t i = 0; i < 4; i++)
            dot[4 * j + i] = (int16_t)(dot[4 * j + i] + lo[g][4 * j + i] * x0[i] + hi[g][4 * j + i] * x1[i]);
      }
      const float a = xr.scale[(m0 + m) * nb + b], qsum = xr.bias[(m0 + m) * nb + b] / -128.f;
      for (int64_t j = 0; j < TN; j++) {
        const int32_t d = (int32_t)dot[4 * j] + dot[4 * j + 1] + dot[4 * j + 2] + dot[4 * j + 3];
        acc[m][j] += a * (s[j] * (float)d + z[j] * qsum);
      }
    }
  }
  store_rows<MB>(acc, acc_io);
}

void bf16_rows(int mb, const bf16* x, int64_t ldx, const bf16* tile, int64_t p0, int64_t p1, float* acc, bool first) {
  with_rows<MAXMB_BF16>(mb, [&](auto rows) { tile_block<decltype(rows)::value>(x, ldx, tile, p0, p1, acc, first); });
}

QuantRows quantize_rows(const bf16* x, int64_t ldx, int64_t M, int64_t K) { return quantize_rows_scalar(x, ldx, M, K); }
