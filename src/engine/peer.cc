#include "engine/peer.h"

#include "common/checks.h"

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
