// Test sizes: the ASan/UBSan run sets KVFERRY_TEST_SCALE=small to keep the suite short.
#pragma once

#include <cstdlib>
#include <cstring>

namespace kvferry::testutil {
inline bool SmallScale() {
  const char* v = std::getenv("KVFERRY_TEST_SCALE");
  return v != nullptr && std::strcmp(v, "small") == 0;
}
}  // namespace kvferry::testutil
