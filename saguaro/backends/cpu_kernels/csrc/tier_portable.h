// portable tier, GEMM tiles: plain C++ that the compiler vectorizes for whatever the target has (SSE2 on any
// x86-64, NEON on aarch64); included by kernels.cpp. Each packed k step is first widened into fp32 / int32
// arrays that stay in L1, then applied to every row with loops over the 64 outputs of the tile.

constexpr int MAXMB_BF16 = 4;
constexpr int MAXMB_Q = 4;

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

// acc += dequantized x[0:MB, blocks b0..b1] . int4 tile: a (s sum(q q_x) + z sum(q_x)) per block
template <int MB>
inline void tile_block_i4(const QuantRows& xr, int64_t m0, int64_t K, const uint8_t* __restrict tile, int64_t b0,
                          int64_t b1, float* __restrict acc_io, bool first) {
  const int64_t nb = K / QB;
  float acc[MB][TN], s[TN], z[TN];
  int32_t q[QB][TN];
  load_rows<MB>(acc, acc_io, first);
  for (int64_t b = b0; b < b1; b++) {
    const uint8_t* w = tile + b * I4_BLOCK;
    for (int64_t g = 0; g < 4; g++)  // byte 4j + i of vector v: output 16v + j, k = 8g + i (low) and 8g + 4 + i
      for (int64_t i = 0; i < 4; i++)
        for (int64_t j = 0; j < TN; j++) {
          const uint8_t code = w[g * 4 * TN + (j / 16) * 64 + (j % 16) * 4 + i];
          q[8 * g + i][j] = code & 15;
          q[8 * g + 4 + i][j] = code >> 4;
        }
    const at::Half* sz = reinterpret_cast<const at::Half*>(w + QB * TN / 2);
    for (int64_t j = 0; j < TN; j++) {
      s[j] = float(sz[j]);
      z[j] = float(sz[TN + j]);
    }
    for (int m = 0; m < MB; m++) {
      const int8_t* xq = xr.q.data() + (m0 + m) * K + b * QB;
      int32_t dot[TN] = {};
      for (int64_t k = 0; k < QB; k++)
        for (int64_t j = 0; j < TN; j++) dot[j] += q[k][j] * xq[k];
      const float a = xr.scale[(m0 + m) * nb + b], qsum = xr.bias[(m0 + m) * nb + b] / -128.f;
      for (int64_t j = 0; j < TN; j++) acc[m][j] += a * (s[j] * (float)dot[j] + z[j] * qsum);
    }
  }
  store_rows<MB>(acc, acc_io);
}

void bf16_rows(int mb, const bf16* x, int64_t ldx, const bf16* tile, int64_t p0, int64_t p1, float* acc, bool first) {
  with_rows<MAXMB_BF16>(mb, [&](auto rows) { tile_block<decltype(rows)::value>(x, ldx, tile, p0, p1, acc, first); });
}

QuantRows quantize_rows(const bf16* x, int64_t ldx, int64_t M, int64_t K) { return quantize_rows_scalar(x, ldx, M, K); }
