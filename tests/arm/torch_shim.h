// The few torch names the CPU kernels' headers use (csrc/common.h, tier_portable.h, attention_*.h), in plain
// C++, so that the portable tier builds as a static program for any architecture (kernel_harness.cpp).
// at::BFloat16 rounds as c10's does (to nearest even; NaN to the quiet NaN 0x7FC0); parallel_for runs its
// range on the calling thread.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace at {

struct BFloat16 {
  uint16_t x = 0;
  BFloat16() = default;
  BFloat16(float v) {  // NOLINT: implicit, as c10's
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    x = v != v ? uint16_t(0x7FC0) : uint16_t((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  }
  operator float() const {
    const uint32_t bits = uint32_t(x) << 16;
    float v;
    std::memcpy(&v, &bits, 4);
    return v;
  }
};

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t /*grain*/, const F& f) {
  if (begin < end) f(begin, end);
}

}  // namespace at

#define TORCH_CHECK(cond, ...)                                     \
  do {                                                             \
    if (!(cond)) {                                                 \
      std::fprintf(stderr, "check failed: %s\n", #cond);           \
      std::exit(3);                                                \
    }                                                              \
  } while (0)
