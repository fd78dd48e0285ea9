// The portable tier's kernels as a static program, without torch or Python, so that the same source runs on
// any architecture (tests/test_arm_kernels.py builds it for x86 and, cross-compiled, runs it under
// qemu-aarch64). Inputs and outputs are raw little-endian arrays in files of a directory:
//
//   kernel_harness gemm IN OUT M K T
//     IN: x.bin bf16 [M, K]; w_bf16.bin, w_i8.bin, w_i4.bin: one weight in each packed layout (csrc/kernels.cpp,
//     quant_pack.h) with T tiles of 64 outputs. OUT: bf16.bin, i8.bin, i4.bin fp32 [M, 64 T] (the int8 product
//     times its per-output scales, as gemm applies them); xq.bin int8 [M, K], xscale.bin fp32 [M, K / 32].
//   kernel_harness attention IN OUT N H KVH D S Q L SCALE
//     IN: qkv.bin bf16 [N, (H + 2 KVH) D]; k.bin, v.bin bf16 [slots, KVH, D]; qi.bin int64 [S, Q]; qv.bin
//     bool [S, Q]; ctx.bin int64 [S, L]; mask.bin bool [S, Q, L]. OUT: attn.bin bf16 [N, H D] (zero where no
//     valid query writes), through attend (one kernel for every pass).
//   kernel_harness norm IN OUT M H EPS
//     IN: x.bin bf16 [M, H], w.bin bf16 [H]. OUT: norm.bin bf16 [M, H].
#include "torch_shim.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace {

#include "common.h"
#include "tier_portable.h"
#include "attention_portable.h"

template <typename T>
std::vector<T> load(const std::string& dir, const char* name, int64_t count) {
  std::ifstream f(dir + "/" + name, std::ios::binary | std::ios::ate);
  TORCH_CHECK(f && (int64_t)f.tellg() == count * (int64_t)sizeof(T));
  std::vector<T> v(count);
  f.seekg(0);
  f.read(reinterpret_cast<char*>(v.data()), count * sizeof(T));
  return v;
}

template <typename T>
void save(const std::string& dir, const char* name, const std::vector<T>& v) {
  std::ofstream f(dir + "/" + name, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  TORCH_CHECK(f.good());
}

// Each tile's fp32 accumulators over register tiles and k chunks, as csrc/kernels.cpp's gemm drives them.
template <typename Rows>
std::vector<float> tiles(int64_t M, int64_t T, int64_t steps, int64_t chunk, int64_t maxmb, Rows rows) {
  std::vector<float> out(M * T * TN), acc(M * TN);
  for (int64_t t = 0; t < T; t++) {
    for_register_tiles(M, steps, chunk, maxmb, [&](int mb, int64_t m, int64_t s0, int64_t s1) {
      rows(t, mb, m, s0, s1, acc.data() + m * TN);
    });
    for (int64_t m = 0; m < M; m++) std::copy_n(acc.data() + m * TN, TN, out.data() + (m * T + t) * TN);
  }
  return out;
}

void gemm(const std::string& in, const std::string& out, int64_t M, int64_t K, int64_t T) {
  const auto x = load<bf16>(in, "x.bin", M * K);
  const auto wb = load<bf16>(in, "w_bf16.bin", T * K * TN);
  const auto w8 = load<uint8_t>(in, "w_i8.bin", T * (K / 4 + 4) * TN * 4);
  const auto w4 = load<uint8_t>(in, "w_i4.bin", T * (K / QB) * I4_BLOCK);
  save(out, "bf16.bin", tiles(M, T, K / 2, KBLOCK, MAXMB_BF16, [&](int64_t t, int mb, int64_t m, int64_t p0,
                                                                   int64_t p1, float* acc) {
    bf16_rows(mb, x.data() + m * K, K, wb.data() + t * K * TN, p0, p1, acc, p0 == 0);
  }));
  const QuantRows xr = quantize_rows(x.data(), K, M, K);
  save(out, "xq.bin", xr.q);
  save(out, "xscale.bin", xr.scale);
  const int64_t tile8 = (K / 4 + 4) * TN * 4;
  auto i8 = tiles(M, T, K / QB, KBLOCK / 16, MAXMB_Q, [&](int64_t t, int mb, int64_t m, int64_t b0, int64_t b1,
                                                        float* acc) {
    with_rows<MAXMB_Q>(mb, [&](auto r) {
      tile_block_i8<decltype(r)::value>(xr, m, K, w8.data() + t * tile8, b0, b1, acc, b0 == 0);
    });
  });
  for (int64_t m = 0; m < M; m++)
    for (int64_t t = 0; t < T; t++) {
      const float* scales = reinterpret_cast<const float*>(w8.data() + t * tile8 + K * TN);
      for (int64_t j = 0; j < TN; j++) i8[(m * T + t) * TN + j] *= scales[j];
    }
  save(out, "i8.bin", i8);
  save(out, "i4.bin", tiles(M, T, K / QB, KBLOCK / 16, MAXMB_I4, [&](int64_t t, int mb, int64_t m, int64_t b0,
                                                                    int64_t b1, float* acc) {
    with_rows<MAXMB_I4>(mb, [&](auto r) {
      tile_block_i4<decltype(r)::value>(xr, m, K, w4.data() + t * (K / QB) * I4_BLOCK, b0, b1, acc, b0 == 0);
    });
  }));
}

void attention(const std::string& in, const std::string& out, char** a) {
  const int64_t N = std::stoll(a[0]), H = std::stoll(a[1]), KVH = std::stoll(a[2]), D = std::stoll(a[3]);
  const int64_t S = std::stoll(a[4]), Q = std::stoll(a[5]), L = std::stoll(a[6]), row = (H + 2 * KVH) * D;
  std::ifstream kf(in + "/k.bin", std::ios::binary | std::ios::ate);
  const int64_t slots = (int64_t)kf.tellg() / (KVH * D * 2);
  const auto qkv = load<bf16>(in, "qkv.bin", N * row);
  const auto kc = load<bf16>(in, "k.bin", slots * KVH * D), vc = load<bf16>(in, "v.bin", slots * KVH * D);
  const auto qi = load<int64_t>(in, "qi.bin", S * Q), ctx = load<int64_t>(in, "ctx.bin", S * L);
  const auto qv = load<uint8_t>(in, "qv.bin", S * Q), mk = load<uint8_t>(in, "mask.bin", S * Q * L);
  std::unique_ptr<bool[]> qvb(new bool[S * Q]), mkb(new bool[S * Q * L]);  // bool: one byte of 0 or 1
  std::copy(qv.begin(), qv.end(), qvb.get());
  std::copy(mk.begin(), mk.end(), mkb.get());
  std::vector<bf16> o(N * H * D, bf16(0.f));
  const AttentionArgs args{S, Q, L, H / KVH, row, qkv.data(), kc.data(), vc.data(), qi.data(), ctx.data(),
                           qvb.get(), mkb.get(), o.data()};
  attend(args, H, KVH, D, std::stof(a[7]));
  save(out, "attn.bin", o);
}

void norm(const std::string& in, const std::string& out, int64_t M, int64_t H, float eps) {
  const auto x = load<bf16>(in, "x.bin", M * H), w = load<bf16>(in, "w.bin", H);
  std::vector<bf16> o(M * H);
  for (int64_t m = 0; m < M; m++) norm_row(x.data() + m * H, w.data(), o.data() + m * H, H, eps);
  save(out, "norm.bin", o);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string op = argc > 3 ? argv[1] : "";
  if (op == "gemm" && argc == 7) {
    gemm(argv[2], argv[3], std::stoll(argv[4]), std::stoll(argv[5]), std::stoll(argv[6]));
  } else if (op == "attention" && argc == 12) {
    attention(argv[2], argv[3], argv + 4);
  } else if (op == "norm" && argc == 7) {
    norm(argv[2], argv[3], std::stoll(argv[4]), std::stoll(argv[5]), std::stof(argv[6]));
  } else {
    std::fprintf(stderr, "usage: see the comment at the top of kernel_harness.cpp\n");
    return 2;
  }
  return 0;
}
