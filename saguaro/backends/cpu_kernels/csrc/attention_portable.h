// Attention over the paged cache with a general boolean mask, in fp32 (avx2 and portable tiers; included by
// kernels.cpp). Plain C++ the compiler vectorizes: dot products over 8 partial sums, value sums over d.
// Probabilities are rounded to bf16 before the value product, as the avx512 tier's are.

inline float dot_bf16(const float* __restrict q, const bf16* __restrict k, int64_t D) {
  float part[8] = {};
  for (int64_t d = 0; d < D; d += 8)
    for (int i = 0; i < 8; i++) part[i] += q[d + i] * bf16_at(k, d + i);
  return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
}

// (AttentionArgs: kernels.cpp; rows of out are written for valid queries only)
// Work item: one valid query and one kv head, with the G query heads that share it (keys and values read once).
void attend(const AttentionArgs& a, int64_t H, int64_t KVH, int64_t D, float fscale) {
  TORCH_CHECK(D % 8 == 0, "attention: head_dim must be a multiple of 8");
  const auto [S, Q, L, G, row, qp, kc, vc, qi, ctx, qv, mk, op] = a;
  at::parallel_for(0, S * Q * KVH, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qf(G * D), sc(G * L), acc(G * D), mx(G), sum(G);
    for (int64_t it = i0; it < i1; it++) {
      const int64_t sq = it / KVH, kvh = it % KVH, s = sq / Q;
      if (!qv[sq]) continue;
      const bool* m = mk + sq * L;
      const int64_t n = qi[sq];
      int64_t len = L;  // up to the last visible context entry
      while (len > 0 && !m[len - 1]) len--;
      for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d++) qf[g * D + d] = float(qp[n * row + (kvh * G + g) * D + d]);
      std::fill(mx.begin(), mx.end(), -INFINITY);
      for (int64_t l = 0; l < len; l++) {
        if (!m[l]) continue;
        const bf16* kr = kc + (ctx[s * L + l] * KVH + kvh) * D;
        for (int64_t g = 0; g < G; g++) {
          sc[g * L + l] = dot_bf16(qf.data() + g * D, kr, D) * fscale;
          mx[g] = std::max(mx[g], sc[g * L + l]);
        }
      }
      for (int64_t g = 0; g < G; g++) {  // fp32 sums; numerators rounded to bf16 for the value product
        sum[g] = 0.f;
        for (int64_t l = 0; l < len; l++) {
          const float p = m[l] ? std::exp(sc[g * L + l] - mx[g]) : 0.f;
          sum[g] += p;
          sc[g * L + l] = round_bf16(p);
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = 0; l < len; l++) {
        if (!m[l]) continue;
        const bf16* vr = vc + (ctx[s * L + l] * KVH + kvh) * D;
        for (int64_t g = 0; g < G; g++) {
          const float p = sc[g * L + l];
          float* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; d++) a[d] += p * bf16_at(vr, d);
        }
      }
      for (int64_t g = 0; g < G; g++) {
        bf16* dst = op + n * H * D + (kvh * G + g) * D;
        const float inv = 1.f / sum[g];
        for (int64_t d = 0; d < D; d++) dst[d] = bf16(acc[g * D + d] * inv);
      }
    }
  });
}
