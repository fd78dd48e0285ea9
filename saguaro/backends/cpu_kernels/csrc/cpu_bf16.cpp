// bf16 CPU kernels for the decode hot path (AVX512-BF16: Zen 4, Sapphire Rapids and later).
//
// Why hand-written: decoding one token reads every weight once, so a step costs
// weight bytes / memory bandwidth, and one core streams ~31-36 GB/s. PyTorch's eager bf16
// matrix-vector product reaches ~10 GB/s and oneDNN's prepacked one ~17 GB/s. What it takes
// to reach the bandwidth (measured, see saguaro/models/fast_forward.py):
//   * weights prepacked so that one output tile is read as a single sequential stream
//     (the packed layout below), and x broadcast against 16 outputs per instruction, so
//     there are no horizontal reductions;
//   * packed weights in 2 MB pages (transparent huge pages): with 4 KB pages the same
//     loop streams at ~22 GB/s, with huge pages at ~32 GB/s;
//   * fp32 accumulation with vdpbf16ps; several rows (verification, batches, tree
//     branches) reuse each loaded weight vector, so 3-6 rows cost about what 1 row does.
//
// Packed weight layout for W [N, K] (nn.Linear): [N/64, K/2, 64, 2]. Tile t holds outputs
// 64t..64t+63; for each k pair, 64 outputs x 2 consecutive k values (the vdpbf16ps pair
// layout). A tile is one contiguous run of memory, read front to back.
//
// Rounding mirrors the eager model where it is cheap (bf16 results of each op, fp32
// accumulation), so the fast path agrees with eager up to bf16 rounding.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t TN = 64;       // outputs per packed tile
constexpr int64_t KBLOCK = 1024;  // k pairs per block when x has more rows than one register tile
constexpr int MAXMB = 6;         // rows per register tile: 4 x 6 accumulators + 4 weights + 1 broadcast

using bf16 = at::BFloat16;

inline float round_bf16(float v) { return float(bf16(v)); }

enum Epilogue : int64_t { PLAIN = 0, SWIGLU = 1, ROUND_BF16 = 2 };

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

// ---------------------------------------------------------------------------------------------
// GEMM: out[m, n] = sum_k x[m, k] w[n, k] over a packed w

// acc (fp32 [MB, 64], row stride 64) += x[0:MB, 2*p0 : 2*p1] . tile pairs p0..p1
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

void tile_rows(int mb, const bf16* x, int64_t ldx, const bf16* tile, int64_t p0, int64_t p1, float* acc, bool first) {
  switch (mb) {
    case 1: tile_block<1>(x, ldx, tile, p0, p1, acc, first); break;
    case 2: tile_block<2>(x, ldx, tile, p0, p1, acc, first); break;
    case 3: tile_block<3>(x, ldx, tile, p0, p1, acc, first); break;
    case 4: tile_block<4>(x, ldx, tile, p0, p1, acc, first); break;
    case 5: tile_block<5>(x, ldx, tile, p0, p1, acc, first); break;
    default: tile_block<6>(x, ldx, tile, p0, p1, acc, first); break;
  }
}

// Walk a tile's rows in register tiles of at most maxmb rows, balanced. With more rows than one
// register tile, k goes in chunks of `chunk` steps (k pairs, or quantized blocks of 32), so the
// tile's chunk of weights stays in L2 while every register tile reads it.
// rows(mb, m, s0, s1): accumulate rows m..m+mb over k steps s0..s1 (s0 == 0 starts the sums).
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

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

#include "quant_gemm.h"  // int8 and int4 draft weights

// Write tile t's accumulators (fp32 [M, 64], row stride 64) through the epilogue; see gemm.
void finish_tile(float* acc, int64_t M, int64_t t, int64_t n, int64_t n_out, int64_t epilogue, bool out_fp32,
                 const bf16* bp, const bf16* rp, int64_t ldr, void* op) {
  if (epilogue == SWIGLU) {
    const int64_t base = t * (TN / 2), valid = std::min<int64_t>(TN / 2, n_out - base);
    for (int64_t m = 0; m < M; m++) {
      bf16* o = static_cast<bf16*>(op) + m * n_out + base;
      const float* a = acc + m * TN;
      for (int64_t j = 0; j < valid; j++) {
        const float g = round_bf16(a[j]), u = round_bf16(a[j + TN / 2]);
        o[j] = bf16(round_bf16(silu(g)) * u);
      }
    }
    return;
  }
  const int64_t base = t * TN, valid = std::min<int64_t>(TN, n - base);
  for (int64_t m = 0; m < M; m++) {
    const float* a = acc + m * TN;
    if (out_fp32) {
      float* o = static_cast<float*>(op) + m * n + base;
      for (int64_t j = 0; j < valid; j++) {
        const float v = a[j] + (bp ? float(bp[base + j]) : 0.f);
        o[j] = epilogue == ROUND_BF16 ? round_bf16(v) : v;
      }
      continue;
    }
    bf16* o = static_cast<bf16*>(op) + m * n + base;
    const bf16* r = rp ? rp + m * ldr + base : nullptr;
    for (int64_t j = 0; j < valid; j++) {
      float v = a[j] + (bp ? float(bp[base + j]) : 0.f);
      if (r) v = float(r[j]) + round_bf16(v);
      o[j] = bf16(v);
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
    for (int64_t t = t0; t < t1; t++) {
      if (int4) {
        const uint8_t* tile = static_cast<const uint8_t*>(wp) + t * (K / QB) * I4_BLOCK;
        for_register_tiles(M, K / QB, KBLOCK / 16, MAXMB_Q, [&](int mb, int64_t m, int64_t b0, int64_t b1) {
          with_rows(mb, [&](auto rows) {
            tile_block_i4<decltype(rows)::value>(xr, m, K, tile, b0, b1, acc.data() + m * TN, b0 == 0);
          });
        });
      } else if (int8) {
        const uint8_t* tile = static_cast<const uint8_t*>(wp) + t * (P + 4) * TN * 4;
        for_register_tiles(M, K / QB, KBLOCK / 16, MAXMB_Q, [&](int mb, int64_t m, int64_t b0, int64_t b1) {
          with_rows(mb, [&](auto rows) {
            tile_block_i8<decltype(rows)::value>(xr, m, K, tile, b0, b1, acc.data() + m * TN, b0 == 0);
          });
        });
        const float* scales = reinterpret_cast<const float*>(tile + P * TN * 4);
        for (int64_t m = 0; m < M; m++)
          for (int64_t j = 0; j < TN; j++) acc[m * TN + j] *= scales[j];
      } else {
        const bf16* tile = static_cast<const bf16*>(wp) + t * P * TN * 2;
        for_register_tiles(M, P, KBLOCK, MAXMB, [&](int mb, int64_t m, int64_t p0, int64_t p1) {
          tile_rows(mb, xp + m * ldx, ldx, tile, p0, p1, acc.data() + m * TN, p0 == 0);
        });
      }
      finish_tile(acc.data(), M, t, n, n_out, epilogue, out_fp32, bp, rp, ldr, op);
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm, as the eager module computes it: normalize in fp32, round to bf16, scale in bf16

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1);
  const int64_t M = x.size(0), H = x.size(1), ldx = x.stride(0);
  auto out = at::empty({M, H}, x.options());
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* w = weight.data_ptr<bf16>();
  bf16* o = out.data_ptr<bf16>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) {
      const bf16* r = xp + m * ldx;
      float ss = 0.f;
      for (int64_t i = 0; i < H; i++) ss += float(r[i]) * float(r[i]);
      const float inv = 1.f / std::sqrt(ss / H + (float)eps);
      for (int64_t i = 0; i < H; i++) o[m * H + i] = bf16(float(w[i]) * round_bf16(float(r[i]) * inv));
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// RoPE ("rotate half") on q and k inside the fused qkv rows, then k/v into the paged cache

// cos/sin: [N, D] bf16 tables (as RotaryEmbedding returns them)
void rope_store(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t H, int64_t KVH, int64_t D) {
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
// attention over the paged cache with a general boolean mask

// exp for x <= 0 (softmax after subtracting the max); Cephes-style polynomial, ~1 ulp.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, fx);
}

// o[0:16*NV] += sum over pairs lp of vp[lp] (x) p pair: vp is [pairs][NV][16 d x 2 l], pp the lane's
// probability pairs (bf16 p[2lp], p[2lp+1] packed in 32 bits).
template <int NV>
inline void lane_accumulate(float* o, const bf16* vp, const int32_t* pp, int64_t pairs) {
  __m512 acc[NV];
#pragma GCC unroll 16
  for (int v = 0; v < NV; v++) acc[v] = _mm512_loadu_ps(o + v * 16);
  for (int64_t lp = 0; lp < pairs; lp++) {
    if (pp[lp] == 0) continue;
    const __m512bh pb = (__m512bh)_mm512_set1_epi32(pp[lp]);
#pragma GCC unroll 16
    for (int v = 0; v < NV; v++)
      acc[v] = _mm512_dpbf16_ps(acc[v], (__m512bh)_mm512_loadu_si512(vp + (lp * NV + v) * 32), pb);
  }
#pragma GCC unroll 16
  for (int v = 0; v < NV; v++) _mm512_storeu_ps(o + v * 16, acc[v]);
}

void lane_accumulate_any(int64_t nv, float* o, const bf16* vp, const int32_t* pp, int64_t pairs) {
  switch (nv) {
    case 1: lane_accumulate<1>(o, vp, pp, pairs); break;
    case 2: lane_accumulate<2>(o, vp, pp, pairs); break;
    case 4: lane_accumulate<4>(o, vp, pp, pairs); break;
    case 8: lane_accumulate<8>(o, vp, pp, pairs); break;
    default: lane_accumulate<16>(o, vp, pp, pairs); break;
  }
}

// q: the first H*D columns of qkv [N, row]; caches [slots, KVH, D]; out [N, H*D].
// Work item: one group s, one kv head, up to 16 (query, head) "lanes" that share it. Scores
// for the 16 lanes come out of one vdpbf16ps per k pair (lanes in the vector, the key's
// pair broadcast); values are accumulated in fp32.
at::Tensor attention(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& query_index, const at::Tensor& query_valid, const at::Tensor& context_slots,
                     const at::Tensor& mask, int64_t H, int64_t KVH, int64_t D, double scale) {
  TORCH_CHECK(qkv.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(D % 16 == 0 && D <= 256 && (D / 16 & (D / 16 - 1)) == 0, "attention: head_dim must be 16, 32, 64, 128 or 256");
  TORCH_CHECK(query_index.is_contiguous() && query_valid.is_contiguous() && context_slots.is_contiguous() &&
              mask.is_contiguous());
  const int64_t N = qkv.size(0), row = qkv.size(1), S = query_index.size(0), Q = query_index.size(1);
  const int64_t L = context_slots.size(1), G = H / KVH;
  auto out = at::empty({N, H * D}, qkv.options());
  const bf16* qp = qkv.data_ptr<bf16>();
  const bf16* kc = k_cache.data_ptr<bf16>();
  const bf16* vc = v_cache.data_ptr<bf16>();
  const int64_t* qi = query_index.data_ptr<int64_t>();
  const bool* qv = query_valid.data_ptr<bool>();
  const int64_t* ctx = context_slots.data_ptr<int64_t>();
  const bool* mk = mask.data_ptr<bool>();
  bf16* op = out.data_ptr<bf16>();

  // work items: (s, kv head, lane block); lanes of group s are (valid query q, head g), q-major
  std::vector<int64_t> item_s, item_lane0, lens(S), nq(S);
  for (int64_t s = 0; s < S; s++) {
    int64_t cnt = 0;
    for (int64_t q = 0; q < Q; q++) cnt += qv[s * Q + q];
    nq[s] = cnt;
    int64_t len = 0;  // attend only up to the last visible context entry of the group
    for (int64_t q = 0; q < Q; q++) {
      if (!qv[s * Q + q]) continue;
      const bool* m = mk + (s * Q + q) * L;
      for (int64_t l = L - 1; l >= len; l--)
        if (m[l]) { len = l + 1; break; }
    }
    lens[s] = len;
    for (int64_t lane0 = 0; lane0 < cnt * G; lane0 += 16) { item_s.push_back(s); item_lane0.push_back(lane0); }
  }
  const int64_t items = (int64_t)item_s.size();
  const float fscale = (float)scale;

  at::parallel_for(0, items * KVH, 1, [&](int64_t i0, int64_t i1) {
    std::vector<int64_t> vq;  // valid query positions of the current group
    std::vector<bf16> qt(D * 16);        // [D/2][16 lanes][2]
    std::vector<float> sc;               // scores [len][16]
    std::vector<int32_t> pp;             // bf16 probability pairs [16 lanes][pairs]
    std::vector<bf16> vp(32 * 2 * D);    // 64 value rows interleaved in pairs [32][D/16][32]
    std::vector<float> acc(16 * D);      // outputs [16 lanes][D]
    for (int64_t it = i0; it < i1; it++) {
      const int64_t item = it / KVH, kvh = it % KVH, s = item_s[item], lane0 = item_lane0[item], len = lens[s];
      vq.clear();
      for (int64_t q = 0; q < Q; q++)
        if (qv[s * Q + q]) vq.push_back(q);
      const int64_t lanes = std::min<int64_t>(16, nq[s] * G - lane0);
      int64_t lane_row[16], lane_head[16], lane_q[16];
      for (int64_t i = 0; i < 16; i++) {
        const int64_t li = lane0 + std::min(i, lanes - 1);
        lane_q[i] = vq[li / G];
        lane_row[i] = qi[s * Q + lane_q[i]];
        lane_head[i] = kvh * G + li % G;
      }
      for (int64_t d = 0; d < D; d += 2)
        for (int64_t i = 0; i < 16; i++) {
          const bf16* src = qp + lane_row[i] * row + lane_head[i] * D + d;
          qt[(d / 2) * 32 + 2 * i] = src[0];
          qt[(d / 2) * 32 + 2 * i + 1] = src[1];
        }
      // lane bitmasks per distinct query in this block (lanes are q-major)
      int64_t runs = 0, run_q[16];
      __mmask16 run_bits[16];
      for (int64_t i = 0; i < lanes; i++) {
        if (runs == 0 || run_q[runs - 1] != lane_q[i]) { run_q[runs] = lane_q[i]; run_bits[runs] = 0; runs++; }
        run_bits[runs - 1] |= (__mmask16)(1u << i);
      }
      // scores
      sc.resize(len * 16);
      const __m512 ninf = _mm512_set1_ps(-INFINITY);
      __m512 vmax = ninf;
      for (int64_t l0 = 0; l0 < len; l0 += 8) {
        const int64_t nl = std::min<int64_t>(8, len - l0);
        const bf16* kr[8];
        for (int64_t j = 0; j < 8; j++) kr[j] = kc + (ctx[s * L + l0 + std::min(j, nl - 1)] * KVH + kvh) * D;
        // the cache is cold (a layer's weights streamed through since it was written): fetch the
        // next 8 keys and these 8 values into L2 while the scores compute (-20% at 256 tokens)
        for (int64_t j = 0; j < 8; j++) {
          const char* kn = reinterpret_cast<const char*>(kc + (ctx[s * L + std::min(l0 + 8 + j, len - 1)] * KVH + kvh) * D);
          const char* vn = reinterpret_cast<const char*>(vc + (ctx[s * L + l0 + std::min(j, nl - 1)] * KVH + kvh) * D);
          for (int64_t b = 0; b < D * 2; b += 64) {
            _mm_prefetch(kn + b, _MM_HINT_T1);
            _mm_prefetch(vn + b, _MM_HINT_T1);
          }
        }
        __m512 a[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) a[j] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 2) {
          const __m512bh qv2 = (__m512bh)_mm512_loadu_si512(qt.data() + d * 16);
#pragma GCC unroll 8
          for (int j = 0; j < 8; j++) {
            int32_t pair;
            std::memcpy(&pair, kr[j] + d, 4);
            a[j] = _mm512_dpbf16_ps(a[j], qv2, (__m512bh)_mm512_set1_epi32(pair));
          }
        }
        for (int64_t j = 0; j < nl; j++) {
          const int64_t l = l0 + j;
          __mmask16 ok = 0;
          for (int64_t r = 0; r < runs; r++)
            if (mk[(s * Q + run_q[r]) * L + l]) ok |= run_bits[r];
          const __m512 v = _mm512_mask_mov_ps(ninf, ok, _mm512_mul_ps(a[j], _mm512_set1_ps(fscale)));
          _mm512_storeu_ps(sc.data() + l * 16, v);
          vmax = _mm512_max_ps(vmax, v);
        }
      }
      // softmax: fp32 numerators and sums; numerators rounded to bf16 pairs for the value product
      const int64_t pairs = (len + 1) / 2;
      pp.assign(16 * pairs, 0);
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t l = 0; l < len; l++) {
        const __m512 v = _mm512_loadu_ps(sc.data() + l * 16);
        const __mmask16 live = _mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_OQ);
        const __m512 p = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(v, vmax)));
        vsum = _mm512_add_ps(vsum, p);
        alignas(32) uint16_t pb[16];
        _mm256_store_si256(reinterpret_cast<__m256i*>(pb), (__m256i)_mm512_cvtneps_pbh(p));
        uint16_t* dst = reinterpret_cast<uint16_t*>(pp.data()) + (l / 2) * 2 + (l % 2);
        for (int64_t i = 0; i < lanes; i++) dst[i * pairs * 2] = pb[i];
      }
      float sums[16];
      _mm512_storeu_ps(sums, vsum);
      // values: chunks of 64 context rows, interleaved in pairs (L1-sized), applied to every lane
      const int64_t nv = D / 16;
      std::fill(acc.begin(), acc.end(), 0.f);
      const __m512i interleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                                   39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
      for (int64_t lp0 = 0; lp0 < pairs; lp0 += 32) {
        const int64_t lp1 = std::min(pairs, lp0 + 32);
        for (int64_t lp = lp0; lp < lp1; lp++) {
          const int64_t l = 2 * lp;
          const bf16* r0 = vc + (ctx[s * L + l] * KVH + kvh) * D;
          const bf16* r1 = l + 1 < len ? vc + (ctx[s * L + l + 1] * KVH + kvh) * D : nullptr;
          for (int64_t v = 0; v < nv; v++) {
            const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + v * 16)));
            const __m512i b = r1 ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + v * 16)))
                                 : _mm512_setzero_si512();
            _mm512_storeu_si512(vp.data() + ((lp - lp0) * nv + v) * 32, _mm512_permutex2var_epi16(a, interleave, b));
          }
        }
        for (int64_t i = 0; i < lanes; i++)
          lane_accumulate_any(nv, acc.data() + i * D, vp.data(), pp.data() + i * pairs + lp0, lp1 - lp0);
      }
      for (int64_t i = 0; i < lanes; i++) {
        bf16* dst = op + lane_row[i] * H * D + lane_head[i] * D;
        const float inv = 1.f / sums[i];
        for (int64_t d = 0; d < D; d++) dst[d] = bf16(acc[i * D + d] * inv);
      }
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// all decoder layers in one call (saves ~8 Python-level calls per layer)

// weights: 7 per layer: input norm, packed qkv, qkv bias (empty if none), packed o, post-attention
// norm, packed gate/up (SwiGLU tiles), packed down. kv: the cache [layers, 2, slots, KVH, D].
at::Tensor forward_layers(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv,
                          const at::Tensor& slot_mapping, const at::Tensor& query_index, const at::Tensor& query_valid,
                          const at::Tensor& context_slots, const at::Tensor& mask, const std::vector<at::Tensor>& weights,
                          int64_t H, int64_t KVH, int64_t D, int64_t inter, double eps, double scale) {
  TORCH_CHECK(weights.size() % 7 == 0 && (int64_t)weights.size() / 7 == kv.size(0));
  const int64_t hidden = x.size(1), qkv_rows = (H + 2 * KVH) * D;
  for (size_t i = 0; i < weights.size() / 7; i++) {
    const at::Tensor* w = &weights[7 * i];
    at::Tensor k_cache = kv.select(0, (int64_t)i).select(0, 0), v_cache = kv.select(0, (int64_t)i).select(0, 1);
    c10::optional<at::Tensor> bias;
    if (w[2].numel()) bias = w[2];
    at::Tensor qkv = gemm(rms_norm(x, w[0], eps), w[1], qkv_rows, bias, c10::nullopt, PLAIN, false);
    rope_store(qkv, cos, sin, k_cache, v_cache, slot_mapping, H, KVH, D);
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
  m.def("gemm", &gemm, "x @ packed^T with bias / residual / SwiGLU epilogues",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm as the eager module rounds it",
        py::call_guard<py::gil_scoped_release>());
  m.def("rope_store", &rope_store, "RoPE on the fused qkv rows in place; k/v into the paged cache",
        py::call_guard<py::gil_scoped_release>());
  m.def("forward_layers", &forward_layers, "every decoder layer: norms, projections, RoPE, cache writes, attention, MLP",
        py::call_guard<py::gil_scoped_release>());
  m.def("attention", &attention, "masked attention of the new tokens over their context slots",
        py::call_guard<py::gil_scoped_release>());
}
