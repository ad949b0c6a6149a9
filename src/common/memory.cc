#include "kvferry/memory.h"

namespace kvferry {
std::string_view MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost:
      return "host";
    case MemoryKind::kCuda:
      return "cuda";
  }
  return "unknown";
}
}  // namespace kvferry
