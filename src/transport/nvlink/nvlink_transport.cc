#include "transport/nvlink/nvlink_transport.h"

#include <unistd.h>

#include <algorithm>
#include <random>

#include "common/checks.h"
#include "cuda/device_memory.h"
#include "transport/nvlink/nvlink_channel.h"

namespace kvferry {

NvlinkTransport::NvlinkTransport(const NvlinkTransportOptions& options) : options_(options) {
  capabilities_.name = "nvlink";
  capabilities_.local_memory = MemoryKindBit(MemoryKind::kCuda);
  capabilities_.remote_memory = MemoryKindBit(MemoryKind::kCuda);
  capabilities_.same_node_only = true;
  capabilities_.strided_rows = true;
  capabilities_.notifications = false;
}

StatusOr<std::unique_ptr<NvlinkTransport>> NvlinkTransport::Create(
    const NvlinkTransportOptions& options, MemoryRegistry* registry) {
  if (options.copy_blocks_per_sm < 1 || options.copy_blocks_per_sm > 8) {
    return InvalidArgumentError("nvlink_copy_blocks_per_sm must be in 1..8, got " +
                                std::to_string(options.copy_blocks_per_sm));
  }
  if (!NvlinkAvailable()) {
    return FailedPreconditionError("transport 'nvlink' needs a CUDA build and a CUDA device: " +
                                   cuda::CheckDevice(0).message());
  }
  std::unique_ptr<NvlinkTransport> transport(new NvlinkTransport(options));
  std::random_device rd;
  const std::string name = "kvferry-" + std::to_string(::getpid()) + "-" +
                           std::to_string(options.listen_port) + "-" +
                           std::to_string(rd() % 100000);
  // Serves file descriptors of kvferry-allocated (cuMem) device memory to local peers.
  // Only regions peers may access (a descriptor of one maps its whole allocation).
  ASSIGN_OR_RETURN(
      transport->fd_server_,
      FdServer::Create(name, options.auth_secret, [registry](uint64_t key) -> StatusOr<int> {
        for (const auto& r : registry->Regions()) {
          if (r.key == key && r.share_type == ShareHandleType::kPosixFd &&
              (r.access & kAccessRemoteReadWrite) != 0) {
            return cuda::ExportFd(r.base - r.alloc_offset, r.device_id);
          }
        }
        return NotFoundError("no shareable region with that key");
      }));
  return transport;
}

void NvlinkTransport::Describe(SegmentDescriptor* self) const {
  self->transports.push_back(capabilities_.name);
  self->ipc_socket = fd_server_->name();
}

bool NvlinkTransport::CanReach(const SegmentDescriptor&, const SegmentDescriptor& peer) const {
  return std::find(peer.transports.begin(), peer.transports.end(), capabilities_.name) !=
         peer.transports.end();
}

StatusOr<std::shared_ptr<PeerChannel>> NvlinkTransport::OpenChannel(const ChannelSetup& setup) {
  NvlinkChannelOptions o;
  o.peer = *setup.peer;
  o.local_device = setup.local_device;
  o.copy_engine_threshold_bytes = options_.copy_engine_threshold_bytes;
  o.copy_engine_min_row_bytes = options_.copy_engine_min_row_bytes;
  o.resident_blocks = options_.resident_blocks;
  o.resident_min_tiles = options_.resident_min_tiles;
  o.high_priority_streams = options_.high_priority_streams;
  o.copy_blocks_per_sm = options_.copy_blocks_per_sm;
  o.refresh = setup.refresh;
  o.auth_secret = options_.auth_secret;
  ASSIGN_OR_RETURN(std::unique_ptr<PeerChannel> channel, CreateNvlinkChannel(o));
  return std::shared_ptr<PeerChannel>(std::move(channel));
}

}  // namespace kvferry
