// Definitions every tier shares (included first by kernels.cpp, inside its namespace).
#pragma once

constexpr int64_t TN = 64;        // outputs per packed tile
constexpr int64_t KBLOCK = 1024;  // k pairs per block when x has more rows than one register tile
constexpr int64_t QB = 32;        // activation quantization block (and int4 weight group)
constexpr int64_t I4_BLOCK = QB * TN / 2 + 4 * TN;  // int4 bytes per tile and k block: codes, scales, offsets

using bf16 = at::BFloat16;

inline float round_bf16(float v) { return float(bf16(v)); }

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

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

void pack(at::Tensor& dst, const std::vector<at::Tensor>& sources, int64_t epilogue);
