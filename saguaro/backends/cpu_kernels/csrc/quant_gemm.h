// Quantized draft weights for the GEMM in cpu_bf16.cpp (included there, inside its namespace).
//
// Why: a draft step streams the draft's weights, and its cost is what SSD's tree build and
// SD's drafting pay per step; while SSD's draft runs beside the target's verification, the
// bytes it streams also slow the target (the two cores share one memory bus). Fewer bytes per
// weight buy both. Draft arithmetic never touches exactness: verification uses the q the draft
// actually sampled from.
//
// Both formats quantize activations per row in blocks of QB = 32 values to int8 (scale =
// absmax / 127, as llama.cpp's Q8_0) and multiply with vpdpbusd (64 multiply-adds per
// instruction, unsigned weight bytes x signed activation bytes).

constexpr int64_t QB = 32;     // activation quantization block (and int4 weight group)
// rows per register tile of both kernels: 4 x 3 int32 + 4 x 3 fp32 accumulators (with_rows instantiates 1..3;
// measured for int4: 16-output strips of 4-6 rows were 15-35% slower)
constexpr int MAXMB_Q = 3;

struct QuantRows {  // x quantized per row and block
  std::vector<int8_t> q;       // [M, K]
  std::vector<float> scale;    // [M, K / QB]
  std::vector<int32_t> bias;   // [M, K / QB]: -128 * sum of the block's q (the uint8 offset's correction)
};

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
// tile(t, st) gets tile t as st [K/2][64][2], weight (output j, input k) at staged(st, j, k).
template <typename Tile>
void for_staged_tiles(const std::vector<at::Tensor>& sources, int64_t epilogue, int64_t T, int64_t K, Tile tile) {
  auto staging = at::empty({T, K / 2, TN, 2}, at::TensorOptions().dtype(at::kBFloat16));
  pack(staging, sources, epilogue);
  const bf16* sp = staging.data_ptr<bf16>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) tile(t, sp + t * K * TN);
  });
}

inline float staged(const bf16* st, int64_t j, int64_t k) { return float(st[((k / 2) * TN + j) * 2 + k % 2]); }

// kernel(std::integral_constant<int, MB>): a register-tile kernel instantiated for mb = MB rows (1..MAXMB_Q)
template <typename Kernel>
inline void with_rows(int mb, Kernel kernel) {
  static_assert(MAXMB_Q == 3, "with_rows instantiates 1..3 rows");
  switch (mb) {
    case 1: kernel(std::integral_constant<int, 1>{}); break;
    case 2: kernel(std::integral_constant<int, 2>{}); break;
    default: kernel(std::integral_constant<int, 3>{}); break;
  }
}

// A register tile's fp32 accumulators [4 vectors of 16 outputs][MB rows]: zero, or read back from acc_io.
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

// ---------------------------------------------------------------------------------------------
// int8: W8A8, symmetric per output channel
//
// Packed layout for W [N, K]: [T, K/4 + 4, 64, 4] bytes. Tile t holds, for each k quad, 64
// outputs x 4 consecutive k values as (w + 128) in uint8 (vpdpbusd's unsigned operand), then
// 256 bytes of fp32 scales, one per output (w = scale * q).
// sum((q_w + 128) q_x) - 128 sum(q_x) = sum(q_w q_x) per block.

// acc (fp32 [MB, 64], row stride 64) += dequantized x[0:MB, blocks b0..b1] . tile
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

// Pack bf16 rows into the int8 layout above (dst: [T, K/4 + 4, 64, 4] uint8); rows as in `pack`.
void pack_i8(at::Tensor& dst, const std::vector<at::Tensor>& sources, int64_t epilogue) {
  TORCH_CHECK(dst.dim() == 4 && dst.size(2) == TN && dst.size(3) == 4 && dst.is_contiguous() &&
              dst.scalar_type() == at::kByte);
  const int64_t T = dst.size(0), Q = dst.size(1) - 4, K = 4 * Q;
  TORCH_CHECK(K % QB == 0, "pack_i8: K must be a multiple of ", QB);
  uint8_t* out = dst.data_ptr<uint8_t>();
  for_staged_tiles(sources, epilogue, T, K, [&](int64_t t, const bf16* st) {
    uint8_t* o = out + t * (Q + 4) * TN * 4;
    float* scales = reinterpret_cast<float*>(o + Q * TN * 4);
    for (int64_t j = 0; j < TN; j++) {
      float amax = 0.f;
      for (int64_t k = 0; k < K; k++) amax = std::max(amax, std::fabs(staged(st, j, k)));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      scales[j] = amax / 127.f;
      for (int64_t k = 0; k < K; k++) {
        const int32_t q = (int32_t)std::nearbyint(staged(st, j, k) * inv);
        o[((k / 4) * TN + j) * 4 + k % 4] = (uint8_t)(std::clamp(q, -127, 127) + 128);
      }
    }
  });
}


// ---------------------------------------------------------------------------------------------
// int4: W4A8, asymmetric per group of 32 k values (the grid of the GGUF Q4_K blocks the Qwen
// drafts ship in: 16 evenly spaced levels per 32 weights)
//
// Packed layout for W [N, K]: [T, K/32, I4_BLOCK] bytes. For tile t and k block b: 1024 bytes
// of 4-bit codes q in 0..15, then 64 fp16 scales s and 64 fp16 offsets z (w = s q + z). The
// codes are 4 groups g (k = 8g..8g+7 of the block) of 4 vectors v of 64 bytes; byte 4j + i of
// vector v holds output 16v + j at k = 8g + i in its low nibble and at k = 8g + 4 + i in its
// high nibble, so two masks give two vpdpbusd weight operands of the int8 layout.
// sum(w x) over a block = a (s sum(q q_x) + z sum(q_x)), a the activation block's scale.

constexpr int64_t I4_BLOCK = QB * TN / 2 + 4 * TN;  // 1280 bytes: codes, scales, offsets (module attribute)

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
#pragma GCC unroll 4
    for (int v = 0; v < 4; v++)
#pragma GCC unroll 4
      for (int m = 0; m < MB; m++) acc[v][m] = _mm512_setzero_si512();
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
    const uint8_t* sz = w + QB * TN / 2;
#pragma GCC unroll 4
    for (int v = 0; v < 4; v++) {
      const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + v * 32)));
      const __m512 z = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + 2 * TN + v * 32)));
#pragma GCC unroll 4
      for (int m = 0; m < MB; m++) {
        const float a = xr.scale[(m0 + m) * nb + b], qsum = xr.bias[(m0 + m) * nb + b] / -128.f;
        const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[v][m]), s);
        facc[v][m] = _mm512_fmadd_ps(_mm512_fmadd_ps(z, _mm512_set1_ps(qsum), dot), _mm512_set1_ps(a), facc[v][m]);
      }
    }
  }
  store_tile<MB>(facc, acc_io);
}

// Pack bf16 rows into the int4 layout above (dst: [T, K/32, I4_BLOCK] uint8); rows as in `pack`.
// Each group of 32 weights gets the grid from its min to its max in 15 steps (s and z rounded
// to fp16 first, and the codes chosen against the rounded grid).
void pack_i4(at::Tensor& dst, const std::vector<at::Tensor>& sources, int64_t epilogue) {
  TORCH_CHECK(dst.dim() == 3 && dst.size(2) == I4_BLOCK && dst.is_contiguous() && dst.scalar_type() == at::kByte);
  const int64_t T = dst.size(0), nb = dst.size(1), K = nb * QB;
  uint8_t* out = dst.data_ptr<uint8_t>();
  for_staged_tiles(sources, epilogue, T, K, [&](int64_t t, const bf16* st) {
    for (int64_t b = 0; b < nb; b++) {
      uint8_t* o = out + (t * nb + b) * I4_BLOCK;
      std::memset(o, 0, QB * TN / 2);
      at::Half* scales = reinterpret_cast<at::Half*>(o + QB * TN / 2);
      for (int64_t j = 0; j < TN; j++) {
        float w[QB], lo = INFINITY, hi = -INFINITY;
        for (int64_t i = 0; i < QB; i++) {
          w[i] = staged(st, j, b * QB + i);
          lo = std::min(lo, w[i]);
          hi = std::max(hi, w[i]);
        }
        const at::Half s = at::Half((hi - lo) / 15.f), z = at::Half(lo);
        scales[j] = s;
        scales[TN + j] = z;
        const float sf = float(s), inv = sf > 0.f ? 1.f / sf : 0.f;
        for (int64_t i = 0; i < QB; i++) {
          const int32_t q = std::clamp((int32_t)std::nearbyint((w[i] - float(z)) * inv), 0, 15);
          const int64_t g = i / 8, high = (i % 8) / 4, v = j / 16;
          o[g * 4 * TN + v * 64 + (j % 16) * 4 + i % 4] |= (uint8_t)(q << (4 * high));
        }
      }
    }
  });
}
