// GPU memory to a peer without NVLink: requests whose local side is GPU memory travel over a
// channel that moves host memory (the peer's TCP channel, or a UCX channel where UCX cannot
// move GPU memory) through pinned host bounce buffers. A WRITE's chunk is copied device to
// host asynchronously and sent when that copy finished; a READ's chunk is received into a
// bounce buffer and copied host to device asynchronously. Chunks of several requests are in
// flight at once, so the copies overlap the network. No CUDA types here: in a build without
// CUDA the factory reports "no CUDA device".
#pragma once

#include <memory>

#include "transport/transport.h"

namespace kvferry {

struct GpuBounceOptions {
  // The channel that moves the host bounce buffers (and notifications); must outlive this
  // channel's Close.
  PeerChannel* host = nullptr;
  int local_device = 0;  // the GPU of the local memory this channel serves
  int num_buffers = 16;
  uint64_t buffer_bytes = 1ull << 20;
};

// Errors: kUnimplemented / kFailedPrecondition without CUDA or device; kResourceExhausted when
// the pinned buffers cannot be allocated.
StatusOr<std::unique_ptr<PeerChannel>> CreateGpuBounceChannel(const GpuBounceOptions& options);

}  // namespace kvferry
