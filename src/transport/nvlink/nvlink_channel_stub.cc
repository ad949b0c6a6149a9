// Built instead of the NVLink channel when no CUDA compiler was found: the engine includes
// nvlink_channel.h in every build, and here the factory reports that this build has no CUDA.
#include "transport/nvlink/nvlink_channel.h"

namespace kvferry {

bool NvlinkAvailable() { return false; }

StatusOr<std::unique_ptr<PeerChannel>> CreateNvlinkChannel(const NvlinkChannelOptions&) {
  return UnimplementedError("no CUDA device: kvferry was built without CUDA (no nvcc found)");
}

}  // namespace kvferry
