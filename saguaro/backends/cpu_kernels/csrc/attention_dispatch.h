// Which attention kernel runs which group (included by kernels.cpp after the tier's kernels; plain C++).
//
// A group with at least TILED_MIN_QUERIES valid queries, each seeing a leading run of its context slots (a
// prefill chunk), goes to attend_tiled; the rest (decode, verification, tree branches) to the tier's attend.
constexpr int64_t TILED_MIN_QUERIES = 16;

// The tiled groups, and how many leading slots each of their valid queries sees (vis [S, Q]).
std::vector<int64_t> causal_groups(const AttentionArgs& a, std::vector<int64_t>& vis) {
  std::vector<int64_t> groups;
  for (int64_t s = 0; s < a.S; s++) {
    int64_t valid = 0;
    bool prefix = true;
    for (int64_t q = 0; q < a.Q && prefix; q++) {
      if (!a.qv[s * a.Q + q]) continue;
      const bool* m = a.mk + (s * a.Q + q) * a.L;
      int64_t n = a.L;
      while (n > 0 && !m[n - 1]) n--;
      prefix = n > 0 && std::memchr(m, 0, n) == nullptr;
      vis[s * a.Q + q] = n;
      valid++;
    }
    if (prefix && valid >= TILED_MIN_QUERIES) groups.push_back(s);
  }
  return groups;
}

// Masked attention of every valid query: the tiled groups through attend_tiled, the others through attend (with
// the tiled groups' queries marked invalid).
void attend_all(const AttentionArgs& args, int64_t H, int64_t KVH, int64_t D, float fscale) {
  std::vector<int64_t> vis(args.S * args.Q, 0);
  const std::vector<int64_t> tiled = causal_groups(args, vis);
  if (tiled.empty()) {
    attend(args, H, KVH, D, fscale);
    return;
  }
  if ((int64_t)tiled.size() < args.S) {
    std::unique_ptr<bool[]> rest(new bool[args.S * args.Q]);
    std::copy(args.qv, args.qv + args.S * args.Q, rest.get());
    for (int64_t s : tiled) std::fill(rest.get() + s * args.Q, rest.get() + (s + 1) * args.Q, false);
    AttentionArgs others = args;
    others.qv = rest.get();
    attend(others, H, KVH, D, fscale);
  }
  attend_tiled(args, tiled, vis.data(), H, KVH, D, fscale);
}
