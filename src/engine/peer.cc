#include "engine/peer.h"

#include "common/checks.h"
#include "transport/tcp/tcp_transport.h"

namespace kvferry {

StatusOr<PeerChannel*> Peer::ChannelFor(MemoryKind kind, int device) {
  const StatusOr<Transport*>& route = routes[static_cast<size_t>(kind)];
  if (!route.ok()) return route.status();
  Transport* transport = *route;
  std::lock_guard<std::mutex> lock(mu_);
  // A submission racing CloseSegment must not open a channel that nobody closes.
  if (closed_) return UnavailableError("segment " + address + " is closed");
  auto it = channels_.find({transport, device});
  if (it == channels_.end()) {
    ChannelSetup setup;
    setup.peer = &control->descriptor();
    setup.control = control;
    setup.local_kind = kind;
    setup.local_device = device;
    setup.refresh = refresh;
    ASSIGN_OR_RETURN(std::shared_ptr<PeerChannel> channel, transport->OpenChannel(setup));
    it = channels_.emplace(std::make_pair(transport, device), std::move(channel)).first;
  }
  return it->second.get();
}

bool Peer::StillReaches(std::chrono::milliseconds timeout) {
  if (control->restarted()) return false;
  if (control->lane_failures() == lane_failures_seen_.load(std::memory_order_relaxed)) return true;
  std::lock_guard<std::mutex> lock(probe_mu_);
  for (int attempt = 0; attempt < 2 && !control->restarted(); ++attempt) {
    auto described = tcp::TcpTransport::FetchDescriptor(*control, timeout);
    if (described.ok() || described.status().code() != StatusCode::kUnavailable) break;
  }
  // Read after the probe: its own failed connects must not call for another one.
  lane_failures_seen_.store(control->lane_failures(), std::memory_order_relaxed);
  return !control->restarted();
}

void Peer::Close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }
  control->Close();
  if (notify != nullptr && notify != control) notify->Close();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [key, channel] : channels_) {
    if (channel != control) channel->Close();
  }
}

}  // namespace kvferry
