// Quantized draft weights: the packed formats and their packers (shared by every tier; included by kernels.cpp).
//
// Why: a draft step streams the draft's weights, and its cost is what SSD's tree build and SD's drafting pay
// per step; while SSD's draft runs beside the target's verification, the bytes it streams also slow the
// target (the cores share one memory bus). Fewer bytes per weight buy both. Draft arithmetic never touches
// exactness: verification uses the q the draft actually sampled from. Activations are quantized per row in
// blocks of QB = 32 values to int8 (quantize_rows in each tier; scale = absmax / 127, as llama.cpp's Q8_0).
//
// ---------------------------------------------------------------------------------------------
// int8: W8A8, symmetric per output channel
//
// Packed layout for W [N, K]: [T, K/4 + 4, 64, 4] bytes. Tile t holds, for each k quad, 64
// outputs x 4 consecutive k values as (w + 128) in uint8 (vpdpbusd's unsigned operand), then
// 256 bytes of fp32 scales, one per output (w = scale * q).
//
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

// Pack bf16 rows into the int8 layout (dst: [T, K/4 + 4, 64, 4] uint8); rows as in `pack`.
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
