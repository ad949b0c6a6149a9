// The TCP transport, and the control plane of every engine: it listens for peers (serving
// their WRITE, READ, DESCRIBE and NOTIFY frames against the engine's memory registry), opens a
// peer's control channel by "host:port" (the handshake exchanges segment descriptors), carries
// notifications and descriptor queries, and moves data between any memory kinds: host memory
// straight from and into registered memory, GPU memory through pinned bounce buffers.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "kvferry/segment.h"
#include "kvferry/transfer.h"
#include "transport/memory_registry.h"
#include "transport/tcp/tcp_peer.h"
#include "transport/transport.h"

namespace kvferry::tcp {

struct TcpTransportOptions {
  std::string listen_host = "127.0.0.1";
  uint16_t listen_port = 0;  // 0 picks a free one (listen_port())
  int num_lanes = 4;         // connections per peer, 1..64
  // Requests longer than this are sliced over the lanes; 4 KiB..wire::kMaxPayloadBytes.
  uint64_t slice_bytes = 4ull << 20;
  std::chrono::milliseconds connect_timeout{5000};
  uint32_t max_body_bytes = 4u << 20;  // frame bodies (descriptors, notifications) at most
  int max_connections = 1024;          // served at once (TcpServerOptions)
  int max_handshakes = 64;             // of those, in their handshake (TcpServerOptions)
  std::chrono::milliseconds handshake_timeout{10000};
  std::chrono::milliseconds frame_timeout{10000};
  // The shared secret both sides of every handshake prove (common/auth.h); empty: none. The
  // server refuses a non-loopback listen_host without one unless `insecure`.
  std::string auth_secret;
  bool insecure = false;
  // This engine's current descriptor (answers HELLO and DESCRIBE).
  std::function<SegmentDescriptor()> describe;
  // Called for each NOTIFY, on the connection's thread, before it is acknowledged.
  std::function<void(Notification)> on_notification;
};

class TcpServer;
struct TcpServerCounters;

class TcpTransport : public Transport {
 public:
  // Checks the options and starts listening. `registry` (not owned) outlives the transport.
  // Errors: kInvalidArgument for lanes or slice size out of range, kUnavailable when the
  // address cannot be bound.
  static StatusOr<std::unique_ptr<TcpTransport>> Create(const TcpTransportOptions& options,
                                                        MemoryRegistry* registry);
  ~TcpTransport() override;  // stops listening; closes served connections

  uint16_t listen_port() const { return listen_port_; }
  // The serving side's connection and handshake counters (tcp_server.h); valid as long as
  // the transport.
  const TcpServerCounters& server_counters() const;

  // Connects to "host:port" and performs the handshake, sending `self`; the returned control
  // channel carries the peer's descriptor (descriptor()) and moves host memory. Blocks up to
  // connect_timeout. Errors: kInvalidArgument for a bad address, kUnavailable.
  StatusOr<std::shared_ptr<TcpPeer>> Connect(const std::string& address,
                                             const SegmentDescriptor& self);
  // Asks the peer for its current descriptor over `control`. Blocks up to `timeout`.
  // Errors: kDeadlineExceeded, the channel's errors, kInvalidArgument for a malformed answer.
  static StatusOr<SegmentDescriptor> FetchDescriptor(TcpPeer& control,
                                                     std::chrono::milliseconds timeout);

  const TransportCapabilities& capabilities() const override { return capabilities_; }
  void Describe(SegmentDescriptor* self) const override;
  bool CanReach(const SegmentDescriptor& self, const SegmentDescriptor& peer) const override;
  std::string RouteText(MemoryKind local_kind) const override {
    return local_kind == MemoryKind::kCuda ? "tcp, GPU memory through pinned host bounce buffers"
                                           : "tcp";
  }
  // Host memory: setup.control itself. GPU memory: a bounce-buffer channel over it.
  StatusOr<std::shared_ptr<PeerChannel>> OpenChannel(const ChannelSetup& setup) override;

 private:
  explicit TcpTransport(const TcpTransportOptions& options);

  TcpTransportOptions options_;
  TransportCapabilities capabilities_;
  std::unique_ptr<TcpServer> server_;
  uint16_t listen_port_ = 0;
};

}  // namespace kvferry::tcp
