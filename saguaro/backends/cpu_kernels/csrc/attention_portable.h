// Attention over the paged cache with a general boolean mask, in fp32 (avx2 and portable tiers; included by
// kernels.cpp). Plain C++ the compiler vectorizes: dot products over 8 partial sums, value sums over d.
// Probabilities are rounded to bf16 before the value product, as the avx512 tier's are.

inline float bf16_at(const bf16* p, int64_t i) {
  return f32_bits((uint32_t)reinterpret_cast<const uint16_t*>(p)[i] << 16);
}

inline float dot_bf16(const float* __restrict q, const bf16* __restrict k, int64_t D) {
  float part[8] = {};
  for (int64_t d = 0; d < D; d += 8)
    for (int i = 0; i < 8; i++) part[i] += q[d + i] * bf16_at(k, d + i);
  return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
}

// q: the first H*D columns of qkv [N, row]; caches [slots, KVH, D]; out [N, H*D] (rows of valid queries).
// Work item: one valid query and one kv head, with the G query heads that share it (keys and values read once).
at::Tensor attention(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& query_index, const at::Tensor& query_valid, const at::Tensor& context_slots,
                     const at::Tensor& mask, int64_t H, int64_t KVH, int64_t D, double scale) {
  TORCH_CHECK(qkv.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(D % 8 == 0, "attention: head_dim must be a multiple of 8");
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
  const float fscale = (float)scale;
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
  return out;
}
