// How error messages name a byte range: "[0x<start>, +<length>)".
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace kvferry {

inline std::string RangeText(uint64_t addr, uint64_t length) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "[0x%llx, +%llu)", static_cast<unsigned long long>(addr),
                static_cast<unsigned long long>(length));
  return buf;
}

}  // namespace kvferry
