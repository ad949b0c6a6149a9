#include <algorithm>

#include "common/cpus.h"
#include "kvferry/engine.h"

namespace kvferry {

int DefaultLanesPerPeer() { return std::clamp(UsableCpus() / 2, 4, 8); }

}  // namespace kvferry
