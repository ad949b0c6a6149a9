#include "transport/tcp/tcp_transport.h"

#include <algorithm>

#include "common/checks.h"
#include "transport/gpu_bounce_channel.h"
#include "transport/item_waiter.h"
#include "transport/tcp/tcp_server.h"
#include "transport/tcp/wire.h"

namespace kvferry::tcp {

TcpTransport::TcpTransport(const TcpTransportOptions& options) : options_(options) {
  capabilities_.name = "tcp";
  capabilities_.local_memory = MemoryKindBit(MemoryKind::kHost) | MemoryKindBit(MemoryKind::kCuda);
  capabilities_.remote_memory = capabilities_.local_memory;
  capabilities_.same_node_only = false;
  capabilities_.strided_rows = true;
  capabilities_.notifications = true;
}

TcpTransport::~TcpTransport() = default;

StatusOr<std::unique_ptr<TcpTransport>> TcpTransport::Create(const TcpTransportOptions& options,
                                                             MemoryRegistry* registry) {
  if (options.num_lanes < 1 || options.num_lanes > 64) {
    return InvalidArgumentError("tcp_lanes_per_peer must be in 1..64, got " +
                                std::to_string(options.num_lanes));
  }
  if (options.max_connections < 1) {
    return InvalidArgumentError("tcp_max_connections must be >= 1, got " +
                                std::to_string(options.max_connections));
  }
  if (options.max_handshakes < 1) {
    return InvalidArgumentError("tcp_max_handshakes must be >= 1, got " +
                                std::to_string(options.max_handshakes));
  }
  if (options.handshake_timeout.count() <= 0 || options.frame_timeout.count() <= 0) {
    return InvalidArgumentError("tcp_handshake_timeout and tcp_frame_timeout must be positive");
  }
  if (options.slice_bytes < 4096 || options.slice_bytes > wire::kMaxPayloadBytes) {
    return InvalidArgumentError("tcp_slice_bytes must be in 4 KiB..1 GiB, got " +
                                std::to_string(options.slice_bytes));
  }
  std::unique_ptr<TcpTransport> transport(new TcpTransport(options));
  TcpServerOptions server_options;
  server_options.host = options.listen_host;
  server_options.port = options.listen_port;
  server_options.max_body_bytes = options.max_body_bytes;
  server_options.auth_secret = options.auth_secret;
  server_options.insecure = options.insecure;
  server_options.describe = options.describe;
  server_options.on_notification = options.on_notification;
  server_options.max_connections = options.max_connections;
  server_options.max_handshakes = options.max_handshakes;
  server_options.handshake_timeout = options.handshake_timeout;
  server_options.frame_timeout = options.frame_timeout;
  ASSIGN_OR_RETURN(transport->server_, TcpServer::Create(server_options, registry));
  transport->listen_port_ = transport->server_->port();
  return transport;
}

const TcpServerCounters& TcpTransport::server_counters() const { return server_->counters(); }

StatusOr<std::shared_ptr<TcpPeer>> TcpTransport::Connect(const std::string& address,
                                                         const SegmentDescriptor& self) {
  TcpPeerOptions peer_options;
  peer_options.address = address;
  peer_options.self = self;
  peer_options.num_lanes = options_.num_lanes;
  peer_options.slice_bytes = options_.slice_bytes;
  peer_options.connect_timeout = options_.connect_timeout;
  peer_options.max_body_bytes = options_.max_body_bytes;
  peer_options.auth_secret = options_.auth_secret;
  ASSIGN_OR_RETURN(std::unique_ptr<TcpPeer> peer, TcpPeer::Create(peer_options));
  return std::shared_ptr<TcpPeer>(std::move(peer));
}

StatusOr<SegmentDescriptor> TcpTransport::FetchDescriptor(TcpPeer& control,
                                                          std::chrono::milliseconds timeout) {
  auto waiter = std::make_shared<ItemWaiter>();
  auto item = std::make_shared<WorkItem>();
  item->kind = WorkItem::Kind::kDescribe;
  item->owner = waiter.get();
  item->owner_keepalive = waiter;
  control.Submit(item);
  Status status;
  if (!waiter->Wait(std::chrono::steady_clock::now() + timeout, &status)) {
    control.Abandon(item.get(), DeadlineExceededError("describe timed out"));
    return DeadlineExceededError("peer " + control.address() + " did not answer DESCRIBE within " +
                                 std::to_string(timeout.count()) + " ms");
  }
  RETURN_IF_ERROR(status);
  return wire::DecodeDescriptor(item->reply_body);
}

void TcpTransport::Describe(SegmentDescriptor* self) const {
  self->transports.push_back(capabilities_.name);
}

bool TcpTransport::CanReach(const SegmentDescriptor&, const SegmentDescriptor& peer) const {
  return std::find(peer.transports.begin(), peer.transports.end(), capabilities_.name) !=
         peer.transports.end();
}

StatusOr<std::shared_ptr<PeerChannel>> TcpTransport::OpenChannel(const ChannelSetup& setup) {
  if (setup.local_kind == MemoryKind::kHost) return setup.control;
  GpuBounceOptions o;
  o.host = setup.control.get();
  o.local_device = setup.local_device;
  ASSIGN_OR_RETURN(std::unique_ptr<PeerChannel> bounce, CreateGpuBounceChannel(o));
  return std::shared_ptr<PeerChannel>(std::move(bounce));
}

}  // namespace kvferry::tcp
