// FUZZ_CHECK: an invariant of a fuzz target. A failure prints the condition and where, then
// aborts, which libFuzzer reports as a crash and saves the input that caused it. Unlike
// assert() it stays on in release builds.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <span>
#include <string_view>

#define FUZZ_CHECK(condition)                                                       \
  do {                                                                              \
    if (!(condition)) ::kvferry::fuzz::CheckFailed(#condition, __FILE__, __LINE__); \
  } while (0)

namespace kvferry::fuzz {

[[noreturn]] inline void CheckFailed(const char* condition, const char* file, int line) {
  std::fprintf(stderr, "%s:%d: fuzz invariant failed: %s\n", file, line, condition);
  std::abort();
}

inline std::span<const uint8_t> Bytes(const uint8_t* data, size_t size) {
  return std::span<const uint8_t>(data, size);
}

inline std::string_view Text(const uint8_t* data, size_t size) {
  return std::string_view(reinterpret_cast<const char*>(data), size);
}

// Whether `haystack` holds `needle`.
inline bool Mentions(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

}  // namespace kvferry::fuzz
