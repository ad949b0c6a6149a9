#include "transport/tcp/tcp_server.h"

#include <sys/socket.h>

#include "common/logging.h"
#include "transport/tcp/tcp_common.h"

namespace kvferry::tcp {

StatusOr<std::unique_ptr<TcpServer>> TcpServer::Create(const TcpServerOptions& options,
                                                       MemoryRegistry* registry) {
  std::unique_ptr<TcpServer> server(new TcpServer(options, registry));
  asio::error_code ec;
  asio::ip::address ip = asio::ip::make_address(options.host, ec);
  if (ec) return InvalidArgumentError("listen host '" + options.host + "' is not an IP address");
  asio::ip::tcp::endpoint endpoint(ip, options.port);
  server->acceptor_.open(endpoint.protocol(), ec);
  if (!ec) server->acceptor_.set_option(asio::ip::tcp::acceptor::reuse_address(true), ec);
  if (!ec) server->acceptor_.bind(endpoint, ec);
  if (!ec) server->acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return UnavailableError("cannot listen on " + options.host + ":" +
                            std::to_string(options.port) + ": " + ec.message());
  }
  server->port_ = server->acceptor_.local_endpoint().port();
  TcpServer* raw = server.get();
  server->accept_thread_ = std::thread([raw] { raw->AcceptLoop(); });
  return server;
}

TcpServer::~TcpServer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    for (auto& c : connections_) {
      if (c.socket->is_open()) ::shutdown(c.socket->native_handle(), SHUT_RDWR);
    }
  }
  ::shutdown(acceptor_.native_handle(), SHUT_RDWR);
  asio::error_code ec;
  acceptor_.close(ec);
  if (accept_thread_.joinable()) accept_thread_.join();
  for (auto& c : connections_) {
    if (c.thread.joinable()) c.thread.join();
  }
}

void TcpServer::ReapFinished() {
  // Caller holds mu_. Joins threads of connections that ended.
  for (auto it = connections_.begin(); it != connections_.end();) {
    if (it->done) {
      if (it->thread.joinable()) it->thread.join();
      it = connections_.erase(it);
    } else {
      ++it;
    }
  }
}

void TcpServer::AcceptLoop() {
  while (true) {
    auto socket = std::make_unique<asio::ip::tcp::socket>(io_);
    asio::error_code ec;
    acceptor_.accept(*socket, ec);
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    if (ec) {
      if (ec == asio::error::bad_descriptor || ec == asio::error::invalid_argument) return;
      KVF_LOG_WARN("accept failed: {}", ec.message());
      continue;
    }
    TuneSocket(*socket);
    ReapFinished();
    connections_.emplace_back();
    Connection* c = &connections_.back();
    c->socket = std::move(socket);
    c->thread = std::thread([this, c] { Serve(c); });
  }
}

namespace {

struct Reply {
  wire::FrameHeader header;
  std::string body;
};

Status WriteReply(asio::ip::tcp::socket& socket, wire::FrameType type, uint64_t request_id,
                  const Status& status, const std::vector<uint8_t>* body_bytes = nullptr) {
  wire::FrameHeader h;
  h.type = type;
  h.request_id = request_id;
  h.status = static_cast<uint32_t>(status.code());
  std::string text = status.ok() ? std::string() : status.message();
  h.body_bytes = static_cast<uint32_t>(body_bytes != nullptr ? body_bytes->size() : text.size());
  wire::HeaderBytes hb = wire::EncodeFrameHeader(h);
  std::array<asio::const_buffer, 2> out{
      asio::buffer(hb), body_bytes != nullptr ? asio::buffer(*body_bytes) : asio::buffer(text)};
  asio::error_code ec;
  asio::write(socket, out, ec);
  if (ec) return UnavailableError(ec.message());
  return OkStatus();
}

}  // namespace

void TcpServer::Serve(Connection* connection) {
  asio::ip::tcp::socket& socket = *connection->socket;
  std::string peer_endpoint;
  {
    asio::error_code ec;
    auto ep = socket.remote_endpoint(ec);
    peer_endpoint = ec ? "unknown" : ep.address().to_string() + ":" + std::to_string(ep.port());
  }
  SegmentDescriptor peer;
  bool greeted = false;
  std::string close_reason;
  std::vector<uint8_t> body;
  // Acknowledgements of successful WRITEs wait here while more requests are already queued in
  // the socket, then leave in one send: small WRITEs otherwise cost one send() each.
  // Replies keep their order: everything queued goes out before any other reply.
  constexpr size_t kMaxQueuedAcks = 64;
  std::vector<wire::HeaderBytes> queued_acks;
  auto flush_acks = [&]() -> bool {
    if (queued_acks.empty()) return true;
    asio::error_code wec;
    asio::write(socket, asio::buffer(queued_acks.data(), queued_acks.size() * sizeof(queued_acks[0])),
                wec);
    queued_acks.clear();
    return !wec;
  };
  while (close_reason.empty()) {
    asio::error_code ec;
    if (!queued_acks.empty() &&
        (queued_acks.size() >= kMaxQueuedAcks || socket.available(ec) == 0 || ec)) {
      if (!flush_acks()) break;
    }
    auto header = ReadHeader(socket, options_.max_body_bytes, ec);
    if (ec) break;  // peer closed or connection reset: nothing to report
    if (!header.ok()) {
      close_reason = "malformed frame: " + header.status().message();
      break;
    }
    const wire::FrameHeader& h = *header;
    if (h.type != wire::FrameType::kWrite && !flush_acks()) break;
    if (!greeted && h.type != wire::FrameType::kHello) {
      close_reason = std::string("first frame is ") + std::string(wire::FrameTypeName(h.type)) +
                     ", not HELLO";
      break;
    }
    body.resize(h.body_bytes);
    if (!body.empty()) {
      asio::read(socket, asio::buffer(body), ec);
      if (ec) break;
    }
    Status io;
    switch (h.type) {
      case wire::FrameType::kHello: {
        if (greeted) {
          close_reason = "second HELLO on one connection";
          break;
        }
        auto desc = wire::DecodeDescriptor(body);
        if (!desc.ok()) {
          WriteReply(socket, wire::FrameType::kHelloAck, h.request_id, desc.status())
              .IgnoreError();
          close_reason = "bad HELLO: " + desc.status().message();
          break;
        }
        peer = std::move(*desc);
        greeted = true;
        std::vector<uint8_t> mine = wire::EncodeDescriptor(options_.describe());
        io = WriteReply(socket, wire::FrameType::kHelloAck, h.request_id, OkStatus(), &mine);
        break;
      }
      case wire::FrameType::kWrite: {
        auto pin = registry_->PinRange(h.addr, h.length, kAccessRemoteWrite);
        if (!pin.ok()) {
          Discard(socket, h.length, ec);
          if (ec || !flush_acks()) break;
          io = WriteReply(socket, wire::FrameType::kWriteAck, h.request_id,
                          pin.status().WithContext("WRITE refused"));
          break;
        }
        if (pin->region().kind != MemoryKind::kHost) {
          Discard(socket, h.length, ec);
          if (ec || !flush_acks()) break;
          io = WriteReply(socket, wire::FrameType::kWriteAck, h.request_id,
                          UnimplementedError("WRITE into device memory over TCP is not "
                                             "supported by this build"));
          break;
        }
        asio::read(socket, asio::buffer(reinterpret_cast<void*>(h.addr), h.length), ec);
        if (ec) break;
        wire::FrameHeader ack;
        ack.type = wire::FrameType::kWriteAck;
        ack.request_id = h.request_id;
        queued_acks.push_back(wire::EncodeFrameHeader(ack));
        break;
      }
      case wire::FrameType::kRead: {
        auto pin = registry_->PinRange(h.addr, h.length, kAccessRemoteRead);
        Status refuse = pin.ok() ? OkStatus() : pin.status().WithContext("READ refused");
        if (pin.ok() && pin->region().kind != MemoryKind::kHost) {
          refuse = UnimplementedError("READ from device memory over TCP is not supported by "
                                      "this build");
        }
        if (!refuse.ok()) {
          io = WriteReply(socket, wire::FrameType::kReadData, h.request_id, refuse);
          break;
        }
        wire::FrameHeader r;
        r.type = wire::FrameType::kReadData;
        r.request_id = h.request_id;
        r.length = h.length;
        wire::HeaderBytes hb = wire::EncodeFrameHeader(r);
        std::array<asio::const_buffer, 2> out{
            asio::buffer(hb), asio::buffer(reinterpret_cast<const void*>(h.addr), h.length)};
        asio::write(socket, out, ec);
        if (ec) io = UnavailableError(ec.message());
        break;
      }
      case wire::FrameType::kNotify: {
        if (options_.on_notification) {
          options_.on_notification(
              Notification{peer.name, peer.Address(), std::string(body.begin(), body.end())});
        }
        io = WriteReply(socket, wire::FrameType::kNotifyAck, h.request_id, OkStatus());
        break;
      }
      case wire::FrameType::kDescribe: {
        std::vector<uint8_t> mine = wire::EncodeDescriptor(options_.describe());
        io = WriteReply(socket, wire::FrameType::kDescribeAck, h.request_id, OkStatus(), &mine);
        break;
      }
      default:
        close_reason = std::string("unexpected ") + std::string(wire::FrameTypeName(h.type)) +
                       " from a client";
        break;
    }
    if (ec || !io.ok()) break;
  }
  flush_acks();  // WRITEs that landed before the connection closes are still acknowledged
  if (!close_reason.empty()) {
    KVF_LOG_WARN("closing connection from {} ({}): {}", peer_endpoint,
                 peer.name.empty() ? "no handshake" : peer.name, close_reason);
  }
  asio::error_code ignored;
  socket.shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
  std::lock_guard<std::mutex> lock(mu_);
  connection->done = true;
}

}  // namespace kvferry::tcp
