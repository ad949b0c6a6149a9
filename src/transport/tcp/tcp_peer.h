// Client side of the TCP transport: a pool of persistent connections ("lanes") to one peer.
//
// Every lane runs the authenticated handshake (tcp_common.h) when it connects. Each lane has a
// sender thread that pipelines frames (gathering several small requests into one writev,
// payloads sent straight from the caller's memory) and a receiver thread that matches
// responses in order and reads READ payloads straight into the caller's memory. A
// lane that fails (peer closed, reset, malformed response, abandoned mid-transfer) completes
// everything it held with kUnavailable and is replaced on the next submission.
//
// Thread-safety: TcpPeer is thread-safe.
#pragma once

#include <asio.hpp>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/transport.h"

namespace kvferry::tcp {

struct TcpPeerOptions {
  std::string address;  // peer "host:port"
  SegmentDescriptor self;
  int num_lanes = 4;
  // Requests longer than this are moved as slices spread over the lanes (ChannelTraits).
  uint64_t slice_bytes = 4ull << 20;
  std::chrono::milliseconds connect_timeout{5000};
  uint32_t max_body_bytes = 4u << 20;
  // The shared secret every lane's handshake proves and checks (common/auth.h); empty: none.
  std::string auth_secret;
};

class TcpLane;

class TcpPeer : public PeerChannel {
 public:
  // Connects the first lane and performs the handshake (blocks up to connect_timeout);
  // further lanes connect on first use. Errors: kUnavailable.
  static StatusOr<std::unique_ptr<TcpPeer>> Create(const TcpPeerOptions& options);
  ~TcpPeer() override;

  const SegmentDescriptor& descriptor() const { return descriptor_; }
  const std::string& address() const { return options_.address; }

  void Submit(std::shared_ptr<WorkItem> item) override;
  void SubmitMany(std::vector<std::shared_ptr<WorkItem>>&& items) override;
  void Abandon(WorkItem* item, const Status& why) override;
  void Close() override;

 private:
  explicit TcpPeer(const TcpPeerOptions& options);
  // The lane for the next item (least outstanding bytes; a new one while others are busy).
  // Moves failed lanes whose threads have returned into `reaped`, for the caller to release
  // after unlocking. REQUIRES mu_.
  std::shared_ptr<TcpLane> PickLane(std::vector<std::shared_ptr<TcpLane>>* reaped);
  void SubmitOne(std::shared_ptr<WorkItem> item, bool allow_inline);

  TcpPeerOptions options_;
  SegmentDescriptor descriptor_;
  std::mutex mu_;
  bool closed_ = false;
  std::vector<std::shared_ptr<TcpLane>> lanes_;  // size num_lanes; null until first use
  // Failed lanes, released by PickLane once their threads returned, the rest joined on Close.
  std::vector<std::shared_ptr<TcpLane>> retired_;
};

}  // namespace kvferry::tcp
