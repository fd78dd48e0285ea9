// avx512 tier, attention (AVX512-BF16); included by kernels.cpp.

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

// The 16 lanes' queries as bf16 pairs, lanes in the vector: qt [D/2][16 lanes][2].
inline void lane_queries(bf16* qt, const bf16* qp, int64_t row, const int64_t* lane_row, const int64_t* lane_head,
                         int64_t D) {
  for (int64_t d = 0; d < D; d += 2)
    for (int64_t i = 0; i < 16; i++) {
      const bf16* src = qp + lane_row[i] * row + lane_head[i] * D + d;
      qt[(d / 2) * 32 + 2 * i] = src[0];
      qt[(d / 2) * 32 + 2 * i + 1] = src[1];
    }
}

// The 16 lanes' raw scores against 8 keys: one vdpbf16ps per key pair of dims (the pair broadcast).
inline void scores8(__m512 a[8], const bf16* qt, const bf16* const kr[8], int64_t D) {
#pragma GCC unroll 8
  for (int j = 0; j < 8; j++) a[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 2) {
    const __m512bh q2 = (__m512bh)_mm512_loadu_si512(qt + d * 16);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
      int32_t pair;
      std::memcpy(&pair, kr[j] + d, 4);
      a[j] = _mm512_dpbf16_ps(a[j], q2, (__m512bh)_mm512_set1_epi32(pair));
    }
  }
}

// Softmax numerators exp(score - max) of len keys (sc [len][16], -inf where masked): their fp32 sum per lane,
// and the numerators rounded to bf16 pairs per lane in pp [16 lanes][pairs].
inline __m512 numerators(const float* sc, int64_t len, __m512 vmax, int32_t* pp, int64_t lanes) {
  const int64_t pairs = (len + 1) / 2;
  std::fill(pp, pp + 16 * pairs, 0);
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t l = 0; l < len; l++) {
    const __m512 v = _mm512_loadu_ps(sc + l * 16);
    const __mmask16 live = _mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_OQ);
    const __m512 p = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(v, vmax)));
    vsum = _mm512_add_ps(vsum, p);
    alignas(32) uint16_t pb[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(pb), (__m256i)_mm512_cvtneps_pbh(p));
    uint16_t* dst = reinterpret_cast<uint16_t*>(pp) + (l / 2) * 2 + (l % 2);
    for (int64_t i = 0; i < lanes; i++) dst[i * pairs * 2] = pb[i];
  }
  return vsum;
}

// Two value rows (r1 null past the end) interleaved in pairs for lane_accumulate: vp [nv][16 d x 2 rows].
inline void interleave_rows(bf16* vp, const bf16* r0, const bf16* r1, int64_t nv) {
  const __m512i order = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                         39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  for (int64_t v = 0; v < nv; v++) {
    const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + v * 16)));
    const __m512i b = r1 ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + v * 16)))
                         : _mm512_setzero_si512();
    _mm512_storeu_si512(vp + v * 32, _mm512_permutex2var_epi16(a, order, b));
  }
}

// (AttentionArgs: common.h; rows of out are written for valid queries only)
// Work item: one group, one kv head, up to 16 (query, head) "lanes" that share its keys: decode, verification,
// tree branches and prefill chunks alike. Keys go by blocks of SOFTMAX_BLOCK with an online softmax:
//   * scores: one vdpbf16ps per key pair of dims for the 16 lanes (the pair broadcast), kept in L1 ([64][16]);
//     a lane's mask is a compare of the key index with its visible length when every lane sees a prefix (a
//     causal chunk), the mask's bytes otherwise;
//   * the new max of each lane; its fp32 sum and outputs rescaled by exp(old - new) (0 before its first key);
//   * numerators exp(score - max), fp32 sums of the unrounded ones, each rounded to bf16 for the value product;
//   * the block's value rows interleaved in pairs once for the 16 lanes, accumulated in fp32.
// The item stops at the last key its lanes see, so a causal chunk costs half a square; a block a lane does not
// see would rescale it by exp(0) = 1 and add zeros. Every operation is per lane, so a lane's result depends only
// on its own query, mask and keys, never on the lanes or the pass beside it.
void attend(const AttentionArgs& a, int64_t H, int64_t KVH, int64_t D, float fscale) {
  TORCH_CHECK(D % 16 == 0 && D <= 256 && (D / 16 & (D / 16 - 1)) == 0, "attention: head_dim must be 16, 32, 64, 128 or 256");
  const auto [S, Q, L, G, row, qp, kc, vc, qi, ctx, qv, mk, op] = a;
  const AttentionItems w = attention_items(a, 16);
  const int64_t items = (int64_t)w.s.size(), nv = D / 16, B = SOFTMAX_BLOCK;
  at::parallel_for(0, items * KVH, 1, [&](int64_t i0, int64_t i1) {
    std::vector<bf16> qt(D * 16), vp(B / 2 * nv * 32);
    std::vector<float> sc(B * 16), acc(16 * D);
    std::vector<int32_t> pp(16 * B / 2);
    for (int64_t it = i0; it < i1; it++) {
      const int64_t item = it / KVH, kvh = it % KVH, s = w.s[item], lane0 = w.lane0[item];
      const int64_t lanes = std::min<int64_t>(16, (int64_t)w.valid[s].size() * G - lane0);
      int64_t lane_row[16], lane_head[16], lane_q[16], hi = 0;
      bool prefix = true;
      alignas(64) float lane_vis[16];
      for (int64_t i = 0; i < 16; i++) {  // lanes past the last repeat it (computed, never written)
        const int64_t li = lane0 + std::min(i, lanes - 1);
        const Visible vis = w.vis[s * Q + (lane_q[i] = w.valid[s][li / G])];
        lane_row[i] = qi[s * Q + lane_q[i]];
        lane_head[i] = kvh * G + li % G;
        lane_vis[i] = (float)vis.end;
        hi = std::max(hi, vis.end);
        prefix = prefix && vis.prefix;
      }
      lane_queries(qt.data(), qp, row, lane_row, lane_head, D);
      // lane bitmasks per distinct query (lanes are q-major), for a mask read from its bytes
      int64_t runs = 0, run_q[16];
      __mmask16 run_bits[16];
      for (int64_t i = 0; i < 16; i++) {
        if (runs == 0 || run_q[runs - 1] != lane_q[i]) { run_q[runs] = lane_q[i]; run_bits[runs] = 0; runs++; }
        run_bits[runs - 1] |= (__mmask16)(1u << i);
      }
      const __m512 ninf = _mm512_set1_ps(-INFINITY), seen = _mm512_load_ps(lane_vis);
      __m512 vmax = ninf, vsum = _mm512_setzero_ps();
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b0 = 0; b0 < hi; b0 += B) {
        const int64_t len = std::min(B, hi - b0);
        __m512 bmax = ninf;
        for (int64_t l0 = 0; l0 < len; l0 += 8) {  // scores of 8 keys for the 16 lanes
          const int64_t nl = std::min<int64_t>(8, len - l0);
          const bf16* kr[8];
          for (int64_t j = 0; j < 8; j++) kr[j] = kc + (ctx[s * L + b0 + l0 + std::min(j, nl - 1)] * KVH + kvh) * D;
          // the cache is cold (a layer's weights streamed through since it was written): the next 8 keys and
          // these 8 values into L2 while the scores compute
          for (int64_t j = 0; j < 8; j++) {
            const char* kn = reinterpret_cast<const char*>(kc + (ctx[s * L + std::min(b0 + l0 + 8 + j, hi - 1)] * KVH + kvh) * D);
            const char* vn = reinterpret_cast<const char*>(vc + (ctx[s * L + b0 + l0 + std::min(j, nl - 1)] * KVH + kvh) * D);
            for (int64_t b = 0; b < D * 2; b += 64) {
              _mm_prefetch(kn + b, _MM_HINT_T1);
              _mm_prefetch(vn + b, _MM_HINT_T1);
            }
          }
          __m512 acc8[8];
          scores8(acc8, qt.data(), kr, D);
          for (int64_t j = 0; j < nl; j++) {
            const int64_t l = b0 + l0 + j;
            __mmask16 ok = 0;
            if (prefix) {
              ok = _mm512_cmp_ps_mask(_mm512_set1_ps((float)l), seen, _CMP_LT_OQ);
            } else {
              for (int64_t r = 0; r < runs; r++)
                if (mk[(s * Q + run_q[r]) * L + l]) ok |= run_bits[r];
            }
            const __m512 v = _mm512_mask_mov_ps(ninf, ok, _mm512_mul_ps(acc8[j], _mm512_set1_ps(fscale)));
            _mm512_storeu_ps(sc.data() + (l0 + j) * 16, v);
            bmax = _mm512_max_ps(bmax, v);
          }
        }
        // online softmax: the new max, the old sums and outputs rescaled (0 before a lane's first key)
        const __m512 nmax = _mm512_max_ps(vmax, bmax);
        const __mmask16 fresh = _mm512_cmp_ps_mask(vmax, ninf, _CMP_EQ_OQ);
        const __m512 rescale = _mm512_maskz_mov_ps(~fresh, exp_ps(_mm512_sub_ps(vmax, nmax)));
        vsum = _mm512_mul_ps(vsum, rescale);
        const __mmask16 moved = _mm512_cmp_ps_mask(rescale, _mm512_set1_ps(1.f), _CMP_NEQ_UQ);
        if (moved) {
          alignas(64) float factor[16];
          _mm512_store_ps(factor, rescale);
          for (int64_t i = 0; i < lanes; i++) {
            const __m512 f = _mm512_set1_ps(factor[i]);
            for (int64_t v = 0; v < nv; v++)
              _mm512_storeu_ps(acc.data() + i * D + v * 16, _mm512_mul_ps(f, _mm512_loadu_ps(acc.data() + i * D + v * 16)));
          }
        }
        vmax = nmax;
        const int64_t pairs = (len + 1) / 2;
        vsum = _mm512_add_ps(vsum, numerators(sc.data(), len, vmax, pp.data(), lanes));
        for (int64_t lp = 0; lp < pairs; lp++) {  // the block's value rows, interleaved in pairs
          const int64_t l = 2 * lp;
          const bf16* r0 = vc + (ctx[s * L + b0 + l] * KVH + kvh) * D;
          const bf16* r1 = l + 1 < len ? vc + (ctx[s * L + b0 + l + 1] * KVH + kvh) * D : nullptr;
          interleave_rows(vp.data() + lp * nv * 32, r0, r1, nv);
        }
        for (int64_t i = 0; i < lanes; i++)
          lane_accumulate_any(nv, acc.data() + i * D, vp.data(), pp.data() + i * pairs, pairs);
      }
      float sums[16];
      _mm512_storeu_ps(sums, vsum);
      for (int64_t i = 0; i < lanes; i++) {
        bf16* dst = op + lane_row[i] * H * D + lane_head[i] * D;
        const float inv = 1.f / sums[i];
        for (int64_t d = 0; d < D; d++) dst[d] = bf16(acc[i * D + d] * inv);
      }
    }
  });
}
