// Definitions every tier shares (included first by kernels.cpp, inside its namespace). Plain C++ over at::BFloat16,
// as is every tier header: tests/arm/kernel_harness.cpp builds them without torch.
#pragma once

constexpr int64_t TN = 64;        // outputs per packed tile
constexpr int64_t KBLOCK = 1024;  // k pairs per block when x has more rows than one register tile
constexpr int64_t QB = 32;        // activation quantization block (and int4 weight group)
constexpr int64_t I4_BLOCK = QB * TN / 2 + 4 * TN;  // int4 bytes per tile and k block: codes, scales, offsets

using bf16 = at::BFloat16;


enum Epilogue : int64_t { PLAIN = 0, SWIGLU = 1, ROUND_BF16 = 2 };

struct QuantRows {  // x quantized per row and block
  std::vector<int8_t> q;       // [M, K]
  std::vector<float> scale;    // [M, K / QB]
  std::vector<int32_t> bias;   // [M, K / QB]: -128 * sum of the block's q (the uint8 offset's correction)
};

// kernel(std::integral_constant<int, MB>): a register-tile kernel instantiated for mb = MB rows (1..MAX <= 6)
template <int MAX, typename Kernel>
inline void with_rows(int mb, Kernel kernel) {
  static_assert(MAX >= 1 && MAX <= 6, "with_rows instantiates 1..6 rows");
  switch (std::min(mb, MAX)) {
    case 1: kernel(std::integral_constant<int, 1>{}); break;
    case 2: if constexpr (MAX >= 2) kernel(std::integral_constant<int, 2>{}); break;
    case 3: if constexpr (MAX >= 3) kernel(std::integral_constant<int, 3>{}); break;
    case 4: if constexpr (MAX >= 4) kernel(std::integral_constant<int, 4>{}); break;
    case 5: if constexpr (MAX >= 5) kernel(std::integral_constant<int, 5>{}); break;
    default: if constexpr (MAX >= 6) kernel(std::integral_constant<int, 6>{}); break;
  }
}

// The fp32 value of a bf16 held in the top half of a 32-bit word (bf16 is the top half of an fp32).
inline float f32_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint32_t bits_f32(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

// bf16(v)'s bits as c10::BFloat16 rounds them (to nearest even; NaN to 0x7fc0), without a branch, so that the
// loops using it vectorize (the scalar c10 conversion kept the GEMM epilogues scalar: ~6% of an int4 draft step).
inline uint16_t bf16_bits(float v) {
  const uint32_t u = bits_f32(v);
  return v != v ? uint16_t(0x7fc0) : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float round_bf16(float v) { return f32_bits(uint32_t(bf16_bits(v)) << 16); }  // = float(bf16(v))

inline float bf16_at(const bf16* p, int64_t i) {  // = float(p[i])
  return f32_bits((uint32_t)reinterpret_cast<const uint16_t*>(p)[i] << 16);
}

inline void to_f32(float* dst, const bf16* src, int64_t n) {  // dst[i] = float(src[i]), a loop that vectorizes
  for (int64_t i = 0; i < n; i++) dst[i] = bf16_at(src, i);
}

// The fp32 vector of one register (GCC vector extensions, for kernels written in plain C++): 8 lanes under AVX,
// 4 under SSE or NEON.
#if defined(__AVX__)
constexpr int64_t LANES = 8;
#else
constexpr int64_t LANES = 4;
#endif
using Lanes = float __attribute__((vector_size(LANES * sizeof(float))));
using LaneBits = int32_t __attribute__((vector_size(LANES * sizeof(int32_t))));
using LaneWords = uint32_t __attribute__((vector_size(LANES * sizeof(uint32_t))));

inline float pow2_of(float n) { return f32_bits((uint32_t)((int32_t)n + 127) << 23); }  // 2^n, n whole
inline Lanes pow2_of(Lanes n) {
  const LaneBits bits = (__builtin_convertvector(n, LaneBits) + 127) << 23;
  Lanes v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// exp(x) of a float or of Lanes, for x in [-87.3, 88.3] (clamped to it): a softmax numerator after its max,
// silu's exp(-g). A Cephes-style polynomial, ~1 ulp, with no libm call, so that loops over it vectorize.
// nearbyint is the add-and-subtract of 1.5 * 2^23 (the same rounding, to nearest even).
template <typename V>
inline V exp_poly(V x) {
  const V lo = V{} - 87.3f, hi = V{} + 88.3f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const V fx = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  x = x - fx * 0.693359375f + fx * 2.12194440e-4f;
  V y = V{} + 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.f;
  return y * pow2_of(fx);
}

// rows(mb, m, s0, s1) for register tiles of at most maxmb rows, over k steps in chunks of `chunk`
template <typename Rows>
void for_register_tiles(int64_t M, int64_t steps, int64_t chunk, int64_t maxmb, Rows rows) {
  const int64_t kb = M <= maxmb ? steps : chunk;  // one pass over k when all rows fit the registers
  for (int64_t s0 = 0; s0 < steps; s0 += kb) {
    const int64_t s1 = std::min(steps, s0 + kb);
    for (int64_t m = 0; m < M;) {
      const int64_t left = M - m, chunks = (left + maxmb - 1) / maxmb, mb = (left + chunks - 1) / chunks;
      rows((int)mb, m, s0, s1);
      m += mb;
    }
  }
}

// An attention call's tensors as the tiers read them: q in the first H*D columns of qkv [N, row]; caches
// [slots, KVH, D]; S groups of Q query slots (query_index [S, Q]: rows of qkv; query_valid [S, Q]) over L
// context slots (context_slots [S, L], mask [S, Q, L]); G = H / KVH query heads per kv head; op: out [N, H*D].
struct AttentionArgs {
  int64_t S, Q, L, G, row;
  const bf16 *qp, *kc, *vc;
  const int64_t *qi, *ctx;
  const bool *qv, *mk;
  bf16* op;
};

// Keys per block of every attention kernel's online softmax. A query's scores, numerators, sums and outputs go
// through the same operations in the same order whatever else is in its pass (one query or a prefill chunk, one
// tier's kernel for all), so a prompt's cache bits do not depend on where its chunks fell.
constexpr int64_t SOFTMAX_BLOCK = 64;

// What a query sees: every key it attends is in [0, end); prefix: it attends all of them (a causal run).
struct Visible {
  int64_t end;
  bool prefix;
};

// Work items of an attention call: (group, first lane) per block of `width` lanes. The lanes of group s are its
// (valid query, head) pairs, query-major; valid[s] lists its valid query slots, vis[s * Q + q] what each sees.
struct AttentionItems {
  std::vector<std::vector<int64_t>> valid;
  std::vector<Visible> vis;
  std::vector<int64_t> s, lane0;
};

inline AttentionItems attention_items(const AttentionArgs& a, int64_t width) {
  AttentionItems w{std::vector<std::vector<int64_t>>(a.S), std::vector<Visible>(a.S * a.Q, Visible{0, true}), {}, {}};
  for (int64_t s = 0; s < a.S; s++) {
    for (int64_t q = 0; q < a.Q; q++) {
      if (!a.qv[s * a.Q + q]) continue;
      w.valid[s].push_back(q);
      const bool* m = a.mk + (s * a.Q + q) * a.L;
      int64_t n = a.L;
      while (n > 0 && !m[n - 1]) n--;
      w.vis[s * a.Q + q] = Visible{n, std::memchr(m, 0, n) == nullptr};
    }
    for (int64_t lane0 = 0; lane0 < (int64_t)w.valid[s].size() * a.G; lane0 += width) {
      w.s.push_back(s);
      w.lane0.push_back(lane0);
    }
  }
  return w;
}

// Activations quantized per row and block of QB (scale = absmax / 127, codes rounded to nearest even as
// nearbyint): plain C++, for the tiers without a vector version of it (avx512 has its own).
inline QuantRows quantize_rows_scalar(const bf16* x, int64_t ldx, int64_t M, int64_t K) {
  const int64_t nb = K / QB;
  QuantRows r{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<int32_t>(M * nb)};
  for (int64_t m = 0; m < M; m++)
    for (int64_t b = 0; b < nb; b++) {
      const bf16* src = x + m * ldx + b * QB;
      float v[QB], amax = 0.f;
      for (int64_t i = 0; i < QB; i++) {
        v[i] = float(src[i]);
        amax = std::max(amax, std::fabs(v[i]));
      }
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int64_t i = 0; i < QB; i++) {
        const int32_t q = (int32_t)std::nearbyint(v[i] * inv);
        r.q[m * K + b * QB + i] = (int8_t)q;
        sum += q;
      }
      r.scale[m * nb + b] = amax / 127.f;
      r.bias[m * nb + b] = -128 * sum;
    }
  return r;
}

// o = w * bf16(r / rms(r)) for one row of H values (o may be r)
inline void norm_row(const bf16* r, const bf16* w, bf16* o, int64_t H, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < H; i++) ss += float(r[i]) * float(r[i]);
  const float inv = 1.f / std::sqrt(ss / H + eps);
  for (int64_t i = 0; i < H; i++) o[i] = bf16(float(w[i]) * round_bf16(float(r[i]) * inv));
}
