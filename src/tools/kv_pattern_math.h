// The replay's deterministic KV content, shared by the CPU fill/verify (kv_pattern.cc) and
// the GPU kernels (src/tools/gpu/pattern_kernels.cu), so both produce the same bytes.
//
// Head vector (room, layer, K/V, token, head) holds words PatternWord(HeadSeed(...), i),
// stored little-endian; a trailing partial word keeps its low bytes.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KVF_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVF_HOST_DEVICE inline
#endif

namespace kvferry::pattern {

inline constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;
inline constexpr uint64_t kTokenStep = 0xd1b54a32d192ed03ULL;
inline constexpr uint64_t kHeadStep = 0x8cb92ba72f3d8dd7ULL;

// splitmix64's finalizer: a strong bijective mix, used once per seed.
KVF_HOST_DEVICE uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Word i of a head vector: a cheaper bijective mix (one multiply), used once per 8 bytes.
// Bijective in (seed + i * kGolden), so the words of one head never repeat.
KVF_HOST_DEVICE uint64_t PatternWord(uint64_t seed, uint64_t i) {
  uint64_t x = seed + (i + 1) * kGolden;
  x ^= x >> 32;
  x *= 0xd6e8feb86659fd93ULL;
  return x ^ (x >> 32);
}

// Seed shared by every head vector of one buffer of one request.
KVF_HOST_DEVICE uint64_t BufferSeed(uint64_t room, int layer, int is_value) {
  const uint64_t which = (static_cast<uint64_t>(static_cast<uint32_t>(layer)) << 1) |
                         static_cast<uint64_t>(is_value != 0);
  return Mix64(Mix64(room) + (which + 1) * kGolden);
}

KVF_HOST_DEVICE uint64_t HeadSeed(uint64_t buffer_seed, int64_t token, int head) {
  return Mix64(buffer_seed + static_cast<uint64_t>(token) * kTokenStep +
               static_cast<uint64_t>(static_cast<uint32_t>(head)) * kHeadStep);
}

}  // namespace kvferry::pattern
