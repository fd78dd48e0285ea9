// Attention over the paged cache with a general boolean mask, in fp32 (avx2 and portable tiers; included by
// kernels.cpp): decode, verification, tree branches and prefill chunks alike. Laid out as the avx512 tier's: a
// work item is one group, one kv head and up to ITEM_VECS vectors of LANES (query, head) "lanes" (GCC vector
// extensions, one register wide: 8 fp32 lanes under AVX, 4 under SSE or NEON), so no product is ever reduced
// across a vector. Keys come in blocks of SOFTMAX_BLOCK, converted to fp32 once per item (L1) and used by all
// its lanes, with an online softmax: each lane keeps its running max, fp32 sum and fp32 output, rescaled when
// the max grows.
//   * scores: each lane's query against KEYS keys at once (independent FMA chains), a key's dims broadcast; a
//     lane's dot product is summed over d in order;
//   * numerators exp(score - max) by a polynomial over the lanes (exp_poly), their fp32 sum per block, and the
//     numerators rounded to bf16 before the value product, as every tier's are;
//   * values: added into each lane's output in key order.
// A vector skips a block none of its lanes sees (so a causal chunk costs half a square): for such a lane the
// block would rescale by exp(0) = 1 and add zeros. Every operation is per lane, so a lane's result depends only
// on its own query, mask and keys, never on the lanes or the pass beside it.

// LANES (common.h): (query, head) lanes per vector, one register; KEYS: keys scored together (independent
// FMA chains); WIDE: registers of a lane's output summed at once. Accumulators fill at most half the registers
// (16 ymm or SSE, 32 NEON), so none is spilled. None of them changes a lane's bits.
constexpr int64_t KEYS = 8;
#if defined(__AVX__) || defined(__aarch64__)
constexpr int64_t WIDE = 8;
#else
constexpr int64_t WIDE = 4;
#endif
constexpr int64_t ITEM_VECS = 8;  // vectors of lanes per work item: they share each block's fp32 keys and values

// round_bf16 of each lane, for finite values (as common.h's bf16_bits: to nearest even)
inline Lanes round_lanes(Lanes v) {
  LaneWords u;
  std::memcpy(&u, &v, sizeof u);
  u = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) << 16;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// a[j] = the lanes' queries (qt [D] of Lanes) . key j (kf [KEYS][D] fp32), summed over d in order
inline void lane_scores(Lanes a[KEYS], const Lanes* qt, const float* kf, int64_t D) {
#pragma GCC unroll 8
  for (int64_t j = 0; j < KEYS; j++) a[j] = Lanes{};
  for (int64_t d = 0; d < D; d++) {
    const Lanes q = qt[d];
#pragma GCC unroll 8
    for (int64_t j = 0; j < KEYS; j++) a[j] += q * kf[j * D + d];
  }
}

// o[0 : NV LANES] += sum over the rows r of p[r LANES] * vf[r][0 : NV LANES], in row order, skipping zero
// numerators (a lane's output dims, LANES to a register)
template <int NV>
inline void lane_values(float* o, const float* vf, int64_t D, const float* p, int64_t rows) {
  Lanes acc[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; v++) std::memcpy(&acc[v], o + LANES * v, sizeof(Lanes));
  for (int64_t r = 0; r < rows; r++) {
    const float pr = p[r * LANES];
    if (pr == 0.f) continue;
#pragma GCC unroll 8
    for (int v = 0; v < NV; v++) {
      Lanes w;
      std::memcpy(&w, vf + r * D + LANES * v, sizeof(Lanes));
      acc[v] += pr * w;
    }
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; v++) std::memcpy(o + LANES * v, &acc[v], sizeof(Lanes));
}

// (AttentionArgs: common.h; rows of out are written for valid queries only)
void attend(const AttentionArgs& a, int64_t H, int64_t KVH, int64_t D, float fscale) {
  TORCH_CHECK(D % 8 == 0 && D <= 512, "attention: head_dim must be a multiple of 8, at most 512");
  const auto [S, Q, L, G, row, qp, kc, vc, qi, ctx, qv, mk, op] = a;
  const AttentionItems w = attention_items(a, ITEM_VECS * LANES);
  const int64_t items = (int64_t)w.s.size(), B = SOFTMAX_BLOCK;

  at::parallel_for(0, items * KVH, 1, [&](int64_t i0, int64_t i1) {
    std::vector<Lanes> qt(ITEM_VECS * D), sc(B), mx(ITEM_VECS), sum(ITEM_VECS), seen(ITEM_VECS);
    std::vector<float> kf(B * D, 0.f), vf(B * D), acc(ITEM_VECS * LANES * D);
    for (int64_t it = i0; it < i1; it++) {
      const int64_t item = it / KVH, kvh = it % KVH, s = w.s[item], lane0 = w.lane0[item];
      const int64_t lanes = std::min<int64_t>(ITEM_VECS * LANES, (int64_t)w.valid[s].size() * G - lane0);
      const int64_t vecs = (lanes + LANES - 1) / LANES;
      int64_t lane_row[ITEM_VECS * LANES], lane_head[ITEM_VECS * LANES], vec_end[ITEM_VECS], hi = 0;
      const bool* lane_mask[ITEM_VECS * LANES];
      bool vec_prefix[ITEM_VECS];
      for (int64_t v = 0; v < vecs; v++) {
        vec_end[v] = 0;
        vec_prefix[v] = true;
        for (int64_t i = 0; i < LANES; i++) {  // lanes past the last repeat it (computed, never written)
          const int64_t li = lane0 + std::min(v * LANES + i, lanes - 1), q = w.valid[s][li / G], n = v * LANES + i;
          const Visible vis = w.vis[s * Q + q];
          lane_row[n] = qi[s * Q + q];
          lane_head[n] = kvh * G + li % G;
          lane_mask[n] = mk + (s * Q + q) * L;
          seen[v][i] = (float)vis.end;
          vec_end[v] = std::max(vec_end[v], vis.end);
          vec_prefix[v] = vec_prefix[v] && vis.prefix;
        }
        hi = std::max(hi, vec_end[v]);
        for (int64_t d = 0; d < D; d++)
          for (int64_t i = 0; i < LANES; i++)
            qt[v * D + d][i] = float(qp[lane_row[v * LANES + i] * row + lane_head[v * LANES + i] * D + d]);
        mx[v] = Lanes{} - INFINITY;
        sum[v] = Lanes{};
      }
      std::fill(acc.begin(), acc.begin() + vecs * LANES * D, 0.f);

      for (int64_t b0 = 0; b0 < hi; b0 += B) {
        const int64_t nl = std::min(B, hi - b0);
        for (int64_t l = 0; l < nl; l++) {
          const int64_t slot = (ctx[s * L + b0 + l] * KVH + kvh) * D;
          to_f32(kf.data() + l * D, kc + slot, D);
          to_f32(vf.data() + l * D, vc + slot, D);
        }
        for (int64_t v = 0; v < vecs; v++) {
          if (vec_end[v] <= b0) continue;  // no lane of it sees this block
          // scores, masked keys -inf; the block's max of each lane
          Lanes bmax = Lanes{} - INFINITY;
          for (int64_t l0 = 0; l0 < nl; l0 += KEYS) {
            Lanes dots[KEYS];
            lane_scores(dots, qt.data() + v * D, kf.data() + l0 * D, D);
            for (int64_t j = 0; j < std::min(KEYS, nl - l0); j++) {
              Lanes x = dots[j] * fscale;
              if (vec_prefix[v]) {
                x = Lanes{} + (float)(b0 + l0 + j) < seen[v] ? x : Lanes{} - INFINITY;
              } else {
                for (int64_t i = 0; i < LANES; i++)
                  if (!lane_mask[v * LANES + i][b0 + l0 + j]) x[i] = -INFINITY;
              }
              sc[l0 + j] = x;
              bmax = x > bmax ? x : bmax;
            }
          }
          // the new max; the sum and outputs so far rescaled (0 for a lane that has seen nothing yet)
          const Lanes nmax = bmax > mx[v] ? bmax : mx[v];
          const Lanes rescale = mx[v] == Lanes{} - INFINITY ? Lanes{} : exp_poly(mx[v] - nmax);
          mx[v] = nmax;
          sum[v] *= rescale;
          float* o = acc.data() + v * LANES * D;
          for (int64_t i = 0; i < LANES; i++)
            if (rescale[i] != 1.f)
              for (int64_t d = 0; d < D; d++) o[i * D + d] *= rescale[i];
          // numerators: the block's fp32 sum of the unrounded ones, then each rounded to bf16 (masked: 0)
          Lanes bsum = Lanes{};
          for (int64_t l = 0; l < nl; l++) {
            const Lanes x = sc[l], e = exp_poly(x - nmax);
            const Lanes p = x == Lanes{} - INFINITY ? Lanes{} : e;
            bsum += p;
            sc[l] = round_lanes(p);
          }
          sum[v] += bsum;
          // values, added into every lane's output
          for (int64_t i = 0; i < std::min<int64_t>(LANES, lanes - v * LANES); i++) {
            const float* p = reinterpret_cast<const float*>(sc.data()) + i;
            for (int64_t v0 = 0; v0 < D / LANES;) {  // WIDE, 4, 2 or 1 registers of dims at a time
              const int64_t left = D / LANES - v0;
              float* out = o + i * D + LANES * v0;
              const float* val = vf.data() + LANES * v0;
              if (left >= WIDE) lane_values<WIDE>(out, val, D, p, nl), v0 += WIDE;
              else if (left >= 4) lane_values<4>(out, val, D, p, nl), v0 += 4;
              else if (left >= 2) lane_values<2>(out, val, D, p, nl), v0 += 2;
              else lane_values<1>(out, val, D, p, nl), v0 += 1;
            }
          }
        }
      }
      for (int64_t n = 0; n < lanes; n++) {
        bf16* dst = op + lane_row[n] * H * D + lane_head[n] * D;
        const float inv = 1.f / sum[n / LANES][n % LANES];
        for (int64_t d = 0; d < D; d++) dst[d] = bf16(acc[n * D + d] * inv);
      }
    }
  });
}
