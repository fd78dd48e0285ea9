// Tiled causal attention for multi-row passes (a prefill chunk: many queries, each seeing a prefix of the
// context), avx2 and portable tiers (avx512's: tier_avx512_attention.h); included by kernels.cpp. Plain C++ the
// compiler vectorizes for the tier's flags.
//
// A work item is one group, one kv head and a block of up to TQ queries with the G query heads that share it
// (TQ * G "lanes"). Keys and values stream through in blocks of TK, converted to fp32 once per block and
// used by every lane (the block stays in L1), with an online softmax: each lane keeps its running max, its
// fp32 sum and its fp32 output, rescaled when the max grows. A lane reads only its query's visible prefix, so
// the causal triangle costs half a square. As in the other kernels, each numerator is rounded to bf16
// before the value product, and the sum is of the unrounded ones.

constexpr int64_t TQ = 16;  // queries per work item
constexpr int64_t TK = 64;  // keys per block

inline float dot_tiled(const float* __restrict q, const float* __restrict k, int64_t D) {
  float part[8] = {};
  for (int64_t d = 0; d < D; d += 8)
    for (int i = 0; i < 8; i++) part[i] += q[d + i] * k[d + i];
  return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
}

// groups: the groups to attend here; vis [S, Q]: how many leading context slots each valid query sees.
void attend_tiled(const AttentionArgs& a, const std::vector<int64_t>& groups, const int64_t* vis, int64_t H,
                  int64_t KVH, int64_t D, float fscale) {
  TORCH_CHECK(D % 8 == 0, "attention: head_dim must be a multiple of 8");
  const auto [S, Q, L, G, row, qp, kc, vc, qi, ctx, qv, mk, op] = a;
  std::vector<int64_t> item_s, item_q0;  // (group, first valid query index) per block of TQ valid queries
  std::vector<std::vector<int64_t>> valid(S);
  for (int64_t s : groups) {
    for (int64_t q = 0; q < Q; q++)
      if (qv[s * Q + q]) valid[s].push_back(q);
    for (int64_t b = 0; b < (int64_t)valid[s].size(); b += TQ) { item_s.push_back(s); item_q0.push_back(b); }
  }
  const int64_t items = (int64_t)item_s.size();
  at::parallel_for(0, items * KVH, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qf(TQ * G * D), acc(TQ * G * D), kf(TK * D), vf(TK * D), sc(TK), pr(TK);
    std::vector<float> mx(TQ * G), sum(TQ * G);
    for (int64_t it = i0; it < i1; it++) {
      const int64_t item = it / KVH, kvh = it % KVH, s = item_s[item], b0 = item_q0[item];
      const int64_t nq = std::min<int64_t>(TQ, (int64_t)valid[s].size() - b0), lanes = nq * G;
      int64_t seen[TQ], rows[TQ], hi = 0;  // each query's visible prefix and its row of qkv
      for (int64_t j = 0; j < nq; j++) {
        const int64_t q = valid[s][b0 + j];
        seen[j] = vis[s * Q + q];
        rows[j] = qi[s * Q + q];
        hi = std::max(hi, seen[j]);
      }
      for (int64_t j = 0; j < nq; j++)
        for (int64_t g = 0; g < G; g++)
          for (int64_t d = 0; d < D; d++)
            qf[(j * G + g) * D + d] = float(qp[rows[j] * row + (kvh * G + g) * D + d]) * fscale;
      std::fill(mx.begin(), mx.begin() + lanes, -INFINITY);
      std::fill(sum.begin(), sum.begin() + lanes, 0.f);
      std::fill(acc.begin(), acc.begin() + lanes * D, 0.f);
      for (int64_t l0 = 0; l0 < hi; l0 += TK) {
        const int64_t nl = std::min(TK, hi - l0);
        for (int64_t l = 0; l < nl; l++) {
          const int64_t slot = (ctx[s * L + l0 + l] * KVH + kvh) * D;
          to_f32(kf.data() + l * D, kc + slot, D);
          to_f32(vf.data() + l * D, vc + slot, D);
        }
        for (int64_t lane = 0; lane < lanes; lane++) {
          const int64_t lim = std::min(nl, seen[lane / G] - l0);
          if (lim <= 0) continue;
          const float* q = qf.data() + lane * D;
          float top = -INFINITY;
          for (int64_t l = 0; l < lim; l++) {
            sc[l] = dot_tiled(q, kf.data() + l * D, D);
            top = std::max(top, sc[l]);
          }
          const float m = std::max(mx[lane], top), rescale = std::exp(mx[lane] - m);  // exp(-inf) = 0 at first
          float part[8] = {};
          for (int64_t l = 0; l < lim; l++) {
            pr[l] = exp_poly(sc[l] - m);
            part[l % 8] += pr[l];
            pr[l] = round_bf16(pr[l]);
          }
          float* o = acc.data() + lane * D;
          for (int64_t d = 0; d < D; d++) o[d] *= rescale;
          for (int64_t l = 0; l < lim; l++) {
            const float p = pr[l], *v = vf.data() + l * D;
            for (int64_t d = 0; d < D; d++) o[d] += p * v[d];
          }
          mx[lane] = m;
          sum[lane] = sum[lane] * rescale + (((part[0] + part[4]) + (part[1] + part[5])) +
                                             ((part[2] + part[6]) + (part[3] + part[7])));
        }
      }
      for (int64_t lane = 0; lane < lanes; lane++) {
        bf16* dst = op + rows[lane / G] * H * D + (kvh * G + lane % G) * D;
        const float inv = 1.f / sum[lane];
        for (int64_t d = 0; d < D; d++) dst[d] = bf16(acc[lane * D + d] * inv);
      }
    }
  });
}
