// One peer's UCX channel: WRITE and READ items as ucp_put_nbx / ucp_get_nbx on one endpoint
// (UCP_ERR_HANDLING_MODE_PEER) to the peer's worker, a put or get per row (strided items
// carry several rows), the peer's regions reached through the packed rkeys of its descriptor.
//
// Checks: every item's remote range must lie inside one region of the peer's descriptor with
// the access its op needs and a UCX key; a miss re-reads the descriptor once (off the
// progress thread), then fails with kFailedPrecondition and nothing is moved. A region the
// peer published without a key (GPU memory of a peer whose UCX has no CUDA) is reached over
// the peer's TCP control channel instead, for host memory on this side.
//
// Completion: an item completes once every put or get of it completed (a WRITE also once a
// flush of the endpoint issued after its puts completed: its bytes are in the peer's memory),
// with the first failure of any of them: a flush alone never makes an item succeed. Notifications
// and descriptor queries go over the control channel.
//
// Failures: the endpoint's error callback (a peer that died) and Abandon of an item whose puts
// or gets are moving (a deadline: a frozen peer is never reported by UCX) close the endpoint
// with UCP_EP_CLOSE_FLAG_FORCE, which cancels every operation on it; each item completes once
// UCX called back for all of its operations (kUnavailable, or the abandon's reason). The next
// submission opens a new endpoint.
//
// Thread-safety: the PeerChannel methods from any thread; everything else on the worker's
// progress thread.
#pragma once

#include <memory>

#include "kvferry/segment.h"
#include "transport/transport.h"
#include "transport/ucx/ucx_worker.h"

namespace kvferry::ucx {

struct UcxChannelOptions {
  UcxWorker* worker = nullptr;  // outlives the channel's Close
  SegmentDescriptor peer;
  std::shared_ptr<PeerChannel> control;  // the peer's TCP channel
  std::function<StatusOr<SegmentDescriptor>()> refresh;
  MemoryKind local_kind = MemoryKind::kHost;
  ChannelTraits traits;
};

std::shared_ptr<PeerChannel> CreateUcxChannel(UcxChannelOptions options);

}  // namespace kvferry::ucx
