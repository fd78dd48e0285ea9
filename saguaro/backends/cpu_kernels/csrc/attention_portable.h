// Attention over the paged cache with a general boolean mask, in fp32 (avx2 and portable tiers; included by
// kernels.cpp). Laid out as the avx512 tier's: a work item is one group, one kv head and up to LANES (query,
// head) "lanes" that share its keys, with the lanes in the vector (GCC vector extensions, one register wide: 8
// fp32 lanes under AVX, 4 under SSE or NEON), so no product is ever reduced across a vector.
//   * scores: each lane's query against KEYS keys at once (independent FMA chains), a key's dims broadcast; a
//     lane's dot product is summed over d in order;
//   * numerators exp(score - max) by a polynomial over the lanes (exp_poly), fp32 sums of them, and the
//     numerators rounded to bf16 before the value product, as every tier's are;
//   * values: a block of rows converted to fp32 once (L1) and added into each lane's output in key order.
// Every operation is per lane, so a lane's result never depends on the lanes beside it.

// LANES (common.h): (query, head) lanes per work item, one register; KEYS: keys scored together (independent
// FMA chains); WIDE: registers of a lane's output summed at once. Accumulators fill at most half the registers
// (16 ymm or SSE, 32 NEON), so none is spilled. None of them changes a lane's bits.
constexpr int64_t KEYS = 8;
#if defined(__AVX__) || defined(__aarch64__)
constexpr int64_t WIDE = 8;
#else
constexpr int64_t WIDE = 4;
#endif
constexpr int64_t ROW_FLOATS = 4096;  // fp32 key or value rows converted at a time: KEYS rows, or 16 KB of values

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

  // work items: (group, first lane) per block of LANES lanes; lanes of group s are (valid query, head), q-major
  std::vector<int64_t> item_s, item_lane0, lens(S, 0);
  std::vector<std::vector<int64_t>> valid(S);
  for (int64_t s = 0; s < S; s++) {
    for (int64_t q = 0; q < Q; q++) {
      if (!qv[s * Q + q]) continue;
      valid[s].push_back(q);
      const bool* m = mk + (s * Q + q) * L;
      for (int64_t l = L - 1; l >= lens[s]; l--)  // attend up to the group's last visible context entry
        if (m[l]) { lens[s] = l + 1; break; }
    }
    for (int64_t lane0 = 0; lane0 < (int64_t)valid[s].size() * G; lane0 += LANES) {
      item_s.push_back(s);
      item_lane0.push_back(lane0);
    }
  }
  const int64_t items = (int64_t)item_s.size(), chunk = std::max<int64_t>(KEYS, ROW_FLOATS / D);

  at::parallel_for(0, items * KVH, 1, [&](int64_t i0, int64_t i1) {
    std::vector<Lanes> qt(D), sc;                     // queries [D]; scores, then numerators [len]
    std::vector<float> kf(KEYS * D), vf(chunk * D), acc(LANES * D);
    for (int64_t it = i0; it < i1; it++) {
      const int64_t item = it / KVH, kvh = it % KVH, s = item_s[item], lane0 = item_lane0[item], len = lens[s];
      const int64_t lanes = std::min<int64_t>(LANES, (int64_t)valid[s].size() * G - lane0);
      int64_t lane_row[LANES], lane_head[LANES];
      const bool* lane_mask[LANES];
      for (int64_t i = 0; i < LANES; i++) {  // lanes past the last repeat it (computed, never written)
        const int64_t li = lane0 + std::min(i, lanes - 1), q = valid[s][li / G];
        lane_row[i] = qi[s * Q + q];
        lane_head[i] = kvh * G + li % G;
        lane_mask[i] = mk + (s * Q + q) * L;
      }
      for (int64_t d = 0; d < D; d++)
        for (int64_t i = 0; i < LANES; i++) qt[d][i] = float(qp[lane_row[i] * row + lane_head[i] * D + d]);

      // scores, masked keys -inf; the max of each lane
      sc.resize(len);
      Lanes mx = Lanes{} - INFINITY;
      for (int64_t l0 = 0; l0 < len; l0 += KEYS) {
        const int64_t nl = std::min(KEYS, len - l0);
        for (int64_t j = 0; j < KEYS; j++)
          to_f32(kf.data() + j * D, kc + (ctx[s * L + l0 + std::min(j, nl - 1)] * KVH + kvh) * D, D);
        Lanes dots[KEYS];
        lane_scores(dots, qt.data(), kf.data(), D);
        for (int64_t j = 0; j < nl; j++) {
          Lanes v = dots[j] * fscale;
          for (int64_t i = 0; i < LANES; i++)
            if (!lane_mask[i][l0 + j]) v[i] = -INFINITY;
          sc[l0 + j] = v;
          mx = v > mx ? v : mx;
        }
      }
      // numerators: fp32 sums of the unrounded ones, then each rounded to bf16 (masked: 0)
      Lanes sum = Lanes{};
      for (int64_t l = 0; l < len; l++) {
        const Lanes v = sc[l], e = exp_poly(v - mx);
        const Lanes p = v == Lanes{} - INFINITY ? Lanes{} : e;
        sum += p;
        sc[l] = round_lanes(p);
      }
      // values: blocks of rows in fp32, added into every lane's output
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l0 = 0; l0 < len; l0 += chunk) {
        const int64_t nl = std::min(chunk, len - l0);
        for (int64_t l = 0; l < nl; l++) to_f32(vf.data() + l * D, vc + (ctx[s * L + l0 + l] * KVH + kvh) * D, D);
        for (int64_t i = 0; i < lanes; i++) {
          const float* p = reinterpret_cast<const float*>(sc.data() + l0) + i;
          for (int64_t v0 = 0; v0 < D / LANES;) {  // WIDE, 4, 2 or 1 registers of dims at a time
            const int64_t left = D / LANES - v0;
            float* o = acc.data() + i * D + LANES * v0;
            const float* v = vf.data() + LANES * v0;
            if (left >= WIDE) lane_values<WIDE>(o, v, D, p, nl), v0 += WIDE;
            else if (left >= 4) lane_values<4>(o, v, D, p, nl), v0 += 4;
            else if (left >= 2) lane_values<2>(o, v, D, p, nl), v0 += 2;
            else lane_values<1>(o, v, D, p, nl), v0 += 1;
          }
        }
      }
      for (int64_t i = 0; i < lanes; i++) {
        bf16* dst = op + lane_row[i] * H * D + lane_head[i] * D;
        const float inv = 1.f / sum[i];
        for (int64_t d = 0; d < D; d++) dst[d] = bf16(acc[i * D + d] * inv);
      }
    }
  });
}
