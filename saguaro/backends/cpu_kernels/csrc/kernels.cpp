// CPU kernels for the decode hot path: packed weights, GEMM with fused epilogues, RMSNorm, RoPE + cache
// writes, attention, and every decoder layer in one call.
//
// Why hand-written: decoding one token reads every weight once, so a step costs weight bytes / memory
// bandwidth. PyTorch's eager bf16 matrix-vector product reaches ~10 GB/s of a ~31-36 GB/s core on Zen 4 and
// ~4.4 of ~15 GB/s on Zen 3. What it takes to reach the bandwidth (measured, see model.py):
//   * weights prepacked so that one output tile is read as a single sequential stream (the packed layout
//     below), and x broadcast against a vector of outputs per instruction, so there are no horizontal
//     reductions;
//   * packed weights in 2 MB pages (transparent huge pages): with 4 KB pages the same loop streams at
//     ~22 GB/s, with huge pages at ~32 GB/s (Zen 4).
//
// One source, three tiers, each built as its own extension with its own -m flags (build.py) and chosen at
// run time from the CPU's features: SAGUARO_TIER_AVX512 (AVX512-BF16/VNNI; tier_avx512_*.h),
// SAGUARO_TIER_AVX2 (AVX2/FMA/F16C; tier_avx2.h) and SAGUARO_TIER_PORTABLE (any CPU, aarch64 included:
// plain C++ the compiler vectorizes; tier_portable.h). Every tier reads the same packed formats, so every
// model and draft setting runs everywhere; only speed differs.
//
// Packed bf16 layout for W [N, K] (nn.Linear): [N/64, K/2, 64, 2]. Tile t holds outputs 64t..64t+63; for
// each k pair, 64 outputs x 2 consecutive k values (the vdpbf16ps pair layout). A tile is one contiguous run
// of memory, read front to back. int8 and int4: quant_pack.h.
//
// Rounding mirrors the eager model where it is cheap (bf16 results of each op, fp32 accumulation), so the
// fast path agrees with eager up to bf16 rounding.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(SAGUARO_TIER_AVX512) || defined(SAGUARO_TIER_AVX2)
#include <immintrin.h>
#endif

namespace {

#include "common.h"

// ---------------------------------------------------------------------------------------------
// memory

// Fresh anonymous memory from mmap, 2 MB aligned and advised for huge pages. Not malloc: glibc
// may hand back heap memory that is already faulted in as 4 KB pages (its mmap threshold grows
// after large frees), and then the advice does nothing (measured: 20 of 203 MB in huge pages,
// weights streaming at 21 instead of 31 GB/s).
at::Tensor alloc_huge(int64_t nbytes) {
  constexpr size_t huge = 2u << 20;
  const size_t size = ((size_t)std::max<int64_t>(nbytes, 1) + huge - 1) / huge * huge, mapped = size + huge;
  void* raw = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(raw != MAP_FAILED, "alloc_huge: out of memory (", nbytes, " bytes)");
  const uintptr_t start = (reinterpret_cast<uintptr_t>(raw) + huge - 1) / huge * huge;
  void* p = reinterpret_cast<void*>(start);
#ifdef MADV_HUGEPAGE
  madvise(p, size, MADV_HUGEPAGE);
#endif
  return torch::from_blob(p, {nbytes}, [raw, mapped](void*) { munmap(raw, mapped); },
                          at::TensorOptions().dtype(at::kByte));
}

// Pack the rows of `sources` (stacked in order; all [n_i, K] bf16) into dst [T, K/2, 64, 2].
// SWIGLU: sources are (gate, up); tile t takes gate rows 32t..32t+31, then up rows 32t..32t+31.
// Rows past the end are zero.
void pack(at::Tensor& dst, const std::vector<at::Tensor>& sources, int64_t epilogue) {
  TORCH_CHECK(dst.dim() == 4 && dst.size(2) == TN && dst.size(3) == 2 && dst.is_contiguous() &&
              dst.scalar_type() == at::kBFloat16);
  const int64_t T = dst.size(0), P = dst.size(1);
  std::vector<at::Tensor> src;
  std::vector<const int32_t*> base;
  std::vector<int64_t> first_row;
  int64_t rows = 0;
  for (const auto& s : sources) {
    TORCH_CHECK(s.dim() == 2 && s.size(1) == 2 * P && s.scalar_type() == at::kBFloat16, "pack: bad source");
    src.push_back(s.contiguous());
    base.push_back(reinterpret_cast<const int32_t*>(src.back().data_ptr<bf16>()));
    first_row.push_back(rows);
    rows += s.size(0);
  }
  TORCH_CHECK(epilogue != SWIGLU || (src.size() == 2 && src[0].sizes() == src[1].sizes() && src[0].size(0) % 32 == 0));
  TORCH_CHECK(rows <= T * TN);
  int32_t* out = reinterpret_cast<int32_t*>(dst.data_ptr<bf16>());
  // source row (as a pointer to its k pairs) of output j in tile t, or nullptr for padding
  auto row_of = [&](int64_t t, int64_t j) -> const int32_t* {
    if (epilogue == SWIGLU) {
      const int64_t r = t * (TN / 2) + j % (TN / 2);
      return r < src[0].size(0) ? base[j / (TN / 2)] + r * P : nullptr;
    }
    const int64_t r = t * TN + j;
    for (size_t i = 0; i < src.size(); i++)
      if (r < first_row[i] + src[i].size(0)) return base[i] + (r - first_row[i]) * P;
    return nullptr;
  };
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    const int32_t* rp[TN];
    for (int64_t t = t0; t < t1; t++) {
      for (int64_t j = 0; j < TN; j++) rp[j] = row_of(t, j);
      int32_t* o = out + t * P * TN;
      for (int64_t p0 = 0; p0 < P; p0 += 64) {  // 64 x 64 pair blocks: source and destination stay in L1
        const int64_t p1 = std::min(P, p0 + 64);
        for (int64_t j = 0; j < TN; j++)
          for (int64_t p = p0; p < p1; p++) o[p * TN + j] = rp[j] ? rp[j][p] : 0;
      }
    }
  });
}

#include "quant_pack.h"  // int8 and int4 draft weights: formats and packers

// How the avx2 tier reads one row's weights (stream_tune.py picks them per CPU): a bf16 row as one stream (each
// tile in turn, one pass) or two (tile t beside tile t + T/2), the bytes of software prefetch ahead of each bf16
// stream, and the k blocks ahead of each int8 / int4 stream (0: the hardware prefetchers alone). Other tiers
// ignore them.
inline int64_t g_streams_bf16 = 2, g_prefetch_bf16 = 512, g_prefetch_blocks = 2;
void set_row_reads(int64_t streams, int64_t bf16_bytes, int64_t quant_blocks) {
  TORCH_CHECK(streams == 1 || streams == 2, "a bf16 row is read as 1 or 2 streams, not ", streams);
  TORCH_CHECK(bf16_bytes >= 0 && bf16_bytes % 64 == 0, "the bf16 prefetch distance must be a non-negative "
              "multiple of 64 bytes");
  TORCH_CHECK(quant_blocks >= 0 && quant_blocks <= 8, "the quantized prefetch distance is 0 to 8 blocks");
  g_streams_bf16 = streams;
  g_prefetch_bf16 = bf16_bytes;
  g_prefetch_blocks = quant_blocks;
}

// Each tier defines MAXMB_BF16, MAXMB_Q and MAXMB_I4 (rows per register tile), bf16_rows (a register tile of rows
// against k pairs of one packed tile, into fp32 [rows, 64]), tile_block_i8<MB> / tile_block_i4<MB> (the same
// over quantized k blocks), quantize_rows and attend (attention's work, see attention below).
#if defined(SAGUARO_TIER_AVX512)
#include "tier_avx512_gemm.h"
#include "tier_avx512_attention.h"
constexpr const char* TIER = "avx512";
#elif defined(SAGUARO_TIER_AVX2)
#include "tier_avx2.h"
#include "attention_portable.h"
constexpr const char* TIER = "avx2";
#elif defined(SAGUARO_TIER_PORTABLE)
#include "tier_portable.h"
#include "attention_portable.h"
constexpr const char* TIER = "portable";
#else
#error "define SAGUARO_TIER_AVX512, SAGUARO_TIER_AVX2 or SAGUARO_TIER_PORTABLE"
#endif

void i8_rows(int mb, const QuantRows& xr, int64_t m0, int64_t K, const uint8_t* tile, int64_t b0, int64_t b1,
             float* acc, bool first) {
  with_rows<MAXMB_Q>(mb, [&](auto rows) { tile_block_i8<decltype(rows)::value>(xr, m0, K, tile, b0, b1, acc, first); });
}

void i4_rows(int mb, const QuantRows& xr, int64_t m0, int64_t K, const uint8_t* tile, int64_t b0, int64_t b1,
             float* acc, bool first) {
#if defined(SAGUARO_TIER_AVX512)
  if (mb == MAXMB_I4) return tile_block_i4_wide<MAXMB_I4>(xr, m0, K, tile, b0, b1, acc, first);  // its own kernel
#endif
  with_rows<MAXMB_Q>(mb, [&](auto rows) { tile_block_i4<decltype(rows)::value>(xr, m0, K, tile, b0, b1, acc, first); });
}

// Masked attention of the new tokens over their context slots (the tier's attend: one kernel for every pass).
at::Tensor attention(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& query_index, const at::Tensor& query_valid, const at::Tensor& context_slots,
                     const at::Tensor& mask, int64_t H, int64_t KVH, int64_t D, double scale) {
  TORCH_CHECK(qkv.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(query_index.is_contiguous() && query_valid.is_contiguous() && context_slots.is_contiguous() &&
              mask.is_contiguous());
  TORCH_CHECK(H % KVH == 0 && qkv.size(1) >= H * D, "attention: bad head counts");
  auto out = at::empty({qkv.size(0), H * D}, qkv.options());
  const AttentionArgs args{query_index.size(0), query_index.size(1), context_slots.size(1), H / KVH, qkv.size(1),
                           qkv.data_ptr<bf16>(), k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(),
                           query_index.data_ptr<int64_t>(), context_slots.data_ptr<int64_t>(),
                           query_valid.data_ptr<bool>(), mask.data_ptr<bool>(), out.data_ptr<bf16>()};
  attend(args, H, KVH, D, (float)scale);
  return out;
}

#ifdef SAGUARO_ROW_TWO_TILES
// One row against tiles t0..t1 of a bf16, int8 or int4 matrix: tile t with tile t + half (the tier's row_pair
// takes a pair), so the weights are read as two long streams: one core keeps more reads in flight over two.
// finish(acc, t) takes each tile's sums; returns the first tile not done (an odd one).
template <typename Finish>
int64_t row_two_tiles(bool int4, bool int8, const bf16* x, const QuantRows& xr, int64_t K, const void* w,
                      int64_t t0, int64_t t1, Finish finish) {
  const int64_t half = (t1 - t0) / 2,
                bytes = int4 ? (K / QB) * I4_BLOCK : int8 ? (K / 4 + 4) * TN * 4 : K * TN * 2;
  const uint8_t* tiles = static_cast<const uint8_t*>(w);
  float acc0[TN], acc1[TN];
  for (int64_t t = t0; t < t0 + half; t++) {
    const uint8_t *a = tiles + t * bytes, *b = tiles + (t + half) * bytes;
    row_pair(int4, int8, x, xr, K, a, b, acc0, acc1);
    finish(acc0, t);
    finish(acc1, t + half);
  }
  return t0 + 2 * half;
}
#endif

// Write tile t's accumulators (fp32 [M, 64], row stride 64) through the epilogue; see gemm. Each loop has one
// form per case (bias or none, residual or none), so the compiler vectorizes it; the bits are those of the
// plain expressions (v + bias or v + 0, the residual added to the rounded value).
void finish_tile(float* acc, int64_t M, int64_t t, int64_t n, int64_t n_out, int64_t epilogue, bool out_fp32,
                 const bf16* bp, const bf16* rp, int64_t ldr, void* op) {
  if (epilogue == SWIGLU) {
    const int64_t base = t * (TN / 2), valid = std::min<int64_t>(TN / 2, n_out - base);
    for (int64_t m = 0; m < M; m++) {
      uint16_t* o = reinterpret_cast<uint16_t*>(static_cast<bf16*>(op) + m * n_out + base);
      const float* a = acc + m * TN;
      float g[TN / 2], e[TN / 2];
      for (int64_t j = 0; j < valid; j++) g[j] = round_bf16(a[j]);
      for (int64_t j = 0; j < valid; j++) e[j] = exp_poly(-g[j]);  // vectorized (libm's took 13% of an int4 gate/up GEMM)
      for (int64_t j = 0; j < valid; j++) o[j] = bf16_bits(round_bf16(g[j] / (1.f + e[j])) * round_bf16(a[j + TN / 2]));
    }
    return;
  }
  const int64_t base = t * TN, valid = std::min<int64_t>(TN, n - base);
  float b[TN];  // the bias, or zeros: v + 0 is not always v (-0 + 0 = +0), and the bits must not change
  for (int64_t j = 0; j < valid; j++) b[j] = bp ? bf16_at(bp, base + j) : 0.f;
  for (int64_t m = 0; m < M; m++) {
    const float* a = acc + m * TN;
    if (out_fp32) {
      float* o = static_cast<float*>(op) + m * n + base;
      if (epilogue == ROUND_BF16)
        for (int64_t j = 0; j < valid; j++) o[j] = round_bf16(a[j] + b[j]);
      else
        for (int64_t j = 0; j < valid; j++) o[j] = a[j] + b[j];
      continue;
    }
    uint16_t* o = reinterpret_cast<uint16_t*>(static_cast<bf16*>(op) + m * n + base);
    if (rp) {
      const bf16* r = rp + m * ldr + base;
      for (int64_t j = 0; j < valid; j++) o[j] = bf16_bits(bf16_at(r, j) + round_bf16(a[j] + b[j]));
    } else {
      for (int64_t j = 0; j < valid; j++) o[j] = bf16_bits(a[j] + b[j]);
    }
  }
}

// x [M, K] bf16 (rows may be strided); packed bf16 [T, K/2, 64, 2], int8 [T, K/4 + 4, 64, 4]
// or int4 [T, K/32, I4_BLOCK] (quant_gemm.h); n: real output count.
// PLAIN:  out = x w^T (+ bias) (+ residual), out [M, n] bf16 or fp32.
// ROUND_BF16: as PLAIN into fp32, each value rounded to bf16 first (the eager head's logits).
// SWIGLU: each tile holds 32 gate rows then the 32 matching up rows;
//         out[m, 32t + j] = silu(gate) * up, out [M, n / 2] bf16.
at::Tensor gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                const c10::optional<at::Tensor>& residual, int64_t epilogue, bool out_fp32) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "gemm: x must be [M, K] bf16 rows");
  const bool int4 = packed.dim() == 3, int8 = !int4 && packed.scalar_type() == at::kByte;
  const int64_t M = x.size(0), K = x.size(1), T = packed.size(0);
  TORCH_CHECK(packed.is_contiguous());
  if (int4) {
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.size(2) == I4_BLOCK);
    TORCH_CHECK(packed.size(1) * QB == K, "gemm: x has ", K, " columns, weights ", packed.size(1) * QB);
  } else {
    TORCH_CHECK(packed.dim() == 4 && packed.size(2) == TN && packed.size(3) == (int8 ? 4 : 2));
  }
  const int64_t P = int4 ? 0 : int8 ? packed.size(1) - 4 : packed.size(1);  // k pairs (bf16) or quads (int8)
  TORCH_CHECK(int4 || (int8 ? 4 : 2) * P == K, "gemm: x has ", K, " columns, weights ", (int8 ? 4 : 2) * P);
  TORCH_CHECK(n <= T * TN);
  TORCH_CHECK(!(out_fp32 && (epilogue == SWIGLU || residual)), "gemm: fp32 output only for plain products");
  TORCH_CHECK(out_fp32 || epilogue != ROUND_BF16, "gemm: ROUND_BF16 writes fp32");
  const int64_t n_out = epilogue == SWIGLU ? n / 2 : n;
  auto out = at::empty({M, n_out}, x.options().dtype(out_fp32 ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
  const bf16* xp = x.data_ptr<bf16>();
  const int64_t ldx = x.stride(0);
  const bf16* bp = bias ? bias->data_ptr<bf16>() : nullptr;
  const bf16* rp = nullptr;
  int64_t ldr = 0;
  if (residual) {
    TORCH_CHECK(residual->scalar_type() == at::kBFloat16 && residual->size(0) == M && residual->size(1) == n_out &&
                residual->stride(1) == 1);
    rp = residual->data_ptr<bf16>();
    ldr = residual->stride(0);
  }
  void* op = out.data_ptr();
  const void* wp = packed.data_ptr();
  QuantRows xr;
  if (int8 || int4) xr = quantize_rows(xp, ldx, M, K);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(M * TN);
#ifdef SAGUARO_ROW_TWO_TILES  // one row: two tiles side by side where the tier reads it so; an odd one left below
    if (M == 1 && two_streams(int4, int8))
      t0 = row_two_tiles(int4, int8, xp, xr, K, wp, t0, t1, [&](float* a, int64_t t) {
        finish_tile(a, M, t, n, n_out, epilogue, out_fp32, bp, rp, ldr, op); });
#endif
    for (int64_t t = t0; t < t1; t++) {
      if (int4) {
        const uint8_t* tile = static_cast<const uint8_t*>(wp) + t * (K / QB) * I4_BLOCK;
        for_register_tiles(M, K / QB, KBLOCK / 16, MAXMB_I4, [&](int mb, int64_t m, int64_t b0, int64_t b1) {
          i4_rows(mb, xr, m, K, tile, b0, b1, acc.data() + m * TN, b0 == 0);
        });
      } else if (int8) {
        const uint8_t* tile = static_cast<const uint8_t*>(wp) + t * (P + 4) * TN * 4;
        for_register_tiles(M, K / QB, KBLOCK / 16, MAXMB_Q, [&](int mb, int64_t m, int64_t b0, int64_t b1) {
          i8_rows(mb, xr, m, K, tile, b0, b1, acc.data() + m * TN, b0 == 0);
        });
        const float* scales = reinterpret_cast<const float*>(tile + P * TN * 4);
        for (int64_t m = 0; m < M; m++)
          for (int64_t j = 0; j < TN; j++) acc[m * TN + j] *= scales[j];
      } else {
        const bf16* tile = static_cast<const bf16*>(wp) + t * P * TN * 2;
        for_register_tiles(M, P, KBLOCK_BF16, MAXMB_BF16, [&](int mb, int64_t m, int64_t p0, int64_t p1) {
          bf16_rows(mb, xp + m * ldx, ldx, tile, p0, p1, acc.data() + m * TN, p0 == 0);
        });
      }
      finish_tile(acc.data(), M, t, n, n_out, epilogue, out_fp32, bp, rp, ldr, op);
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm, as the eager module computes it: normalize in fp32, round to bf16, scale in bf16 (norm_row: common.h)

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1);
  const int64_t M = x.size(0), H = x.size(1), ldx = x.stride(0);
  auto out = at::empty({M, H}, x.options());
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* w = weight.data_ptr<bf16>();
  bf16* o = out.data_ptr<bf16>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) norm_row(xp + m * ldx, w, o + m * H, H, (float)eps);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// RoPE ("rotate half") on q and k inside the fused qkv rows, then k/v into the paged cache

// cos/sin: [N, D] bf16 tables (as RotaryEmbedding returns them). q_norm/k_norm: [D] weights of the per-head
// RMSNorm applied to q and k before RoPE (Qwen3), or empty tensors.
void rope_store(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t H, int64_t KVH, int64_t D,
                const at::Tensor& q_norm, const at::Tensor& k_norm, double eps) {
  const bool qk_norm = q_norm.numel() > 0;
  TORCH_CHECK(!qk_norm || (q_norm.numel() == D && k_norm.numel() == D && q_norm.scalar_type() == at::kBFloat16 &&
                           k_norm.scalar_type() == at::kBFloat16), "rope_store: q/k norm weights must be [D] bf16");
  TORCH_CHECK(qkv.is_contiguous() && qkv.size(1) == (H + 2 * KVH) * D);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kBFloat16 && cos.size(1) == D);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == at::kBFloat16);
  const int64_t N = qkv.size(0), half = D / 2, row = (H + 2 * KVH) * D;
  bf16* q = qkv.data_ptr<bf16>();
  const bf16* cp = cos.data_ptr<bf16>();
  const bf16* sp = sin.data_ptr<bf16>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  bf16* kc = k_cache.data_ptr<bf16>();
  bf16* vc = v_cache.data_ptr<bf16>();
  at::parallel_for(0, N, 1, [&](int64_t n0, int64_t n1) {
    std::vector<float> c(D), s(D), tmp(D);
    for (int64_t n = n0; n < n1; n++) {
      for (int64_t i = 0; i < D; i++) { c[i] = float(cp[n * D + i]); s[i] = float(sp[n * D + i]); }
      bf16* r = q + n * row;
      for (int64_t h = 0; h < H + KVH; h++) {  // x * cos + rotate_half(x) * sin, each product rounded
        bf16* x = r + h * D;
        if (qk_norm) norm_row(x, (h < H ? q_norm : k_norm).data_ptr<bf16>(), x, D, (float)eps);
        for (int64_t i = 0; i < D; i++) {
          const float rot = i < half ? -float(x[i + half]) : float(x[i - half]);
          tmp[i] = round_bf16(round_bf16(float(x[i]) * c[i]) + round_bf16(rot * s[i]));
        }
        for (int64_t i = 0; i < D; i++) x[i] = bf16(tmp[i]);
      }
      std::memcpy(kc + slots[n] * KVH * D, r + H * D, KVH * D * sizeof(bf16));
      std::memcpy(vc + slots[n] * KVH * D, r + (H + KVH) * D, KVH * D * sizeof(bf16));
    }
  });
}

// ---------------------------------------------------------------------------------------------
// all decoder layers in one call (saves ~8 Python-level calls per layer)

// weights: 9 per layer: input norm, packed qkv, qkv bias (empty if none), packed o, post-attention
// norm, packed gate/up (SwiGLU tiles), packed down, q norm and k norm (empty if none). kv: the cache [layers, 2, slots, KVH, D].
at::Tensor forward_layers(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv,
                          const at::Tensor& slot_mapping, const at::Tensor& query_index, const at::Tensor& query_valid,
                          const at::Tensor& context_slots, const at::Tensor& mask, const std::vector<at::Tensor>& weights,
                          int64_t H, int64_t KVH, int64_t D, int64_t inter, double eps, double scale) {
  TORCH_CHECK(weights.size() % 9 == 0 && (int64_t)weights.size() / 9 == kv.size(0));
  const int64_t hidden = x.size(1), qkv_rows = (H + 2 * KVH) * D;
  for (size_t i = 0; i < weights.size() / 9; i++) {
    const at::Tensor* w = &weights[9 * i];
    at::Tensor k_cache = kv.select(0, (int64_t)i).select(0, 0), v_cache = kv.select(0, (int64_t)i).select(0, 1);
    c10::optional<at::Tensor> bias;
    if (w[2].numel()) bias = w[2];
    at::Tensor qkv = gemm(rms_norm(x, w[0], eps), w[1], qkv_rows, bias, c10::nullopt, PLAIN, false);
    rope_store(qkv, cos, sin, k_cache, v_cache, slot_mapping, H, KVH, D, w[7], w[8], eps);
    at::Tensor attn = attention(qkv, k_cache, v_cache, query_index, query_valid, context_slots, mask, H, KVH, D, scale);
    x = gemm(attn, w[3], hidden, c10::nullopt, x, PLAIN, false);
    at::Tensor act = gemm(rms_norm(x, w[4], eps), w[5], 2 * inter, c10::nullopt, c10::nullopt, SWIGLU, false);
    x = gemm(act, w[6], hidden, c10::nullopt, x, PLAIN, false);
  }
  return x;
}

}  // namespace

// The forward-pass kernels release the interpreter lock: a speculator thread in the same process
// (saguaro/ssd/thread_link.py) then runs its draft passes while the target's pass runs.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("alloc_huge", &alloc_huge, "uint8 tensor of nbytes in 2 MB-aligned memory advised for huge pages");
  m.def("pack", &pack, "pack weight rows into the tile layout (dst: [T, K/2, 64, 2])");
  m.def("pack_i8", &pack_i8, "quantize and pack weight rows into the int8 tile layout (dst: [T, K/4 + 4, 64, 4])");
  m.def("pack_i4", &pack_i4, "quantize and pack weight rows into the int4 layout (dst: [T, K/32, 1280])");
  m.attr("I4_BLOCK") = I4_BLOCK;
  m.attr("TIER") = TIER;
  m.def("set_row_reads", &set_row_reads, "how one row's weights are read (avx2): bf16 streams, prefetch bytes "
        "ahead of each bf16 stream, k blocks ahead of each int8 / int4 stream");
  m.def("row_reads", [] { return std::make_tuple(g_streams_bf16, g_prefetch_bf16, g_prefetch_blocks); });
  m.def("gemm", &gemm, "x @ packed^T with bias / residual / SwiGLU epilogues",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm as the eager module rounds it",
        py::call_guard<py::gil_scoped_release>());
  m.def("rope_store", &rope_store, "(q/k norm and) RoPE on the fused qkv rows in place; k/v into the paged cache",
        py::call_guard<py::gil_scoped_release>());
  m.def("forward_layers", &forward_layers, "every decoder layer: norms, projections, RoPE, cache writes, attention, MLP",
        py::call_guard<py::gil_scoped_release>());
  m.def("attention", &attention, "masked attention of the new tokens over their context slots",
        py::call_guard<py::gil_scoped_release>());
}
