#include "transport/tcp/tcp_server.h"

#include <sys/socket.h>

#include <array>
#include <deque>
#include <map>

#include "common/auth.h"
#include "common/checks.h"
#include "common/logging.h"
#include "cuda/device_ops.h"
#include "transport/tcp/tcp_common.h"

namespace kvferry::tcp {

namespace {

using Clock = std::chrono::steady_clock;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

// Frame bodies (descriptors, notifications, strided-row headers) are read this much at a time,
// so a header announcing a large body costs memory only as its bytes arrive.
constexpr uint32_t kBodyChunkBytes = 64u << 10;

}  // namespace

StatusOr<std::unique_ptr<TcpServer>> TcpServer::Create(const TcpServerOptions& options,
                                                       MemoryRegistry* registry) {
  std::unique_ptr<TcpServer> server(new TcpServer(options, registry));
  asio::error_code ec;
  asio::ip::address ip = asio::ip::make_address(options.host, ec);
  if (ec) return InvalidArgumentError("listen host '" + options.host + "' is not an IP address");
  RETURN_IF_ERROR(
      CheckListenSecurity("engine", options.host, !options.auth_secret.empty(), options.insecure));
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
  server->watchdog_thread_ = std::thread([raw] { raw->WatchdogLoop(); });
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
  watchdog_cv_.notify_all();
  // Shutting the listening socket down wakes the accept thread; it is closed once that thread
  // stopped using it.
  ::shutdown(acceptor_.native_handle(), SHUT_RDWR);
  if (accept_thread_.joinable()) accept_thread_.join();
  asio::error_code ec;
  acceptor_.close(ec);
  if (watchdog_thread_.joinable()) watchdog_thread_.join();
  for (auto& c : connections_) {
    if (c.thread.joinable()) c.thread.join();
  }
}

std::list<TcpServer::Connection> TcpServer::TakeFinished() {
  std::list<Connection> finished;
  for (auto it = connections_.begin(); it != connections_.end();) {
    auto next = std::next(it);
    if (it->done) finished.splice(finished.end(), connections_, it);
    it = next;
  }
  return finished;
}

void TcpServer::AcceptLoop() {
  while (true) {
    auto socket = std::make_unique<asio::ip::tcp::socket>(io_);
    asio::error_code ec;
    acceptor_.accept(*socket, ec);
    std::list<Connection> finished;  // their threads are joined outside the lock
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      if (ec) {
        if (ec == asio::error::bad_descriptor || ec == asio::error::invalid_argument) return;
        KVF_LOG_WARN_LIMITED("accept failed: {}", ec.message());
        continue;
      }
      TuneSocket(*socket);
      finished = TakeFinished();
      Admit(std::move(socket));
    }
    for (Connection& c : finished) {
      if (c.thread.joinable()) c.thread.join();
    }
  }
}

void TcpServer::Admit(std::unique_ptr<asio::ip::tcp::socket> socket) {
  // Connections still served, and the oldest of them in its handshake (the list is in accept
  // order). One already crowded out is on its way out and counts in neither.
  size_t served = 0, handshaking = 0;
  Connection* oldest = nullptr;
  for (Connection& c : connections_) {
    if (c.done || c.crowded_out.load(std::memory_order_relaxed)) continue;
    ++served;
    if (!c.authenticated) {
      ++handshaking;
      if (oldest == nullptr) oldest = &c;
    }
  }
  const bool full = served >= static_cast<size_t>(std::max(options_.max_connections, 1));
  asio::error_code ignored;
  if (oldest != nullptr &&
      (full || handshaking >= static_cast<size_t>(std::max(options_.max_handshakes, 1)))) {
    // The watchdog's way of closing: its thread sees the reads fail and ends. Counted here,
    // before its client can see the close.
    oldest->crowded_out.store(true);
    counters_.handshakes_refused[static_cast<size_t>(HandshakeRefusal::kCrowded)].fetch_add(
        1, std::memory_order_relaxed);
    if (oldest->socket->is_open()) ::shutdown(oldest->socket->native_handle(), SHUT_RDWR);
  } else if (full) {
    auto ep = socket->remote_endpoint(ignored);
    KVF_LOG_WARN_LIMITED("refusing a connection from {}: {} connections open (max_connections)",
                         ignored ? "unknown" : ep.address().to_string(), served);
    socket->close(ignored);
    counters_.connections_refused.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  counters_.connections_accepted.fetch_add(1, std::memory_order_relaxed);
  counters_.connections_open.fetch_add(1, std::memory_order_relaxed);
  connections_.emplace_back();
  Connection* c = &connections_.back();
  c->deadline_ns.store(NowNs() + std::chrono::nanoseconds(options_.handshake_timeout).count());
  c->socket = std::move(socket);
  c->thread = std::thread([this, c] { Serve(c); });
}

void TcpServer::WatchdogLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    watchdog_cv_.wait_for(lock, std::chrono::milliseconds(100));
    if (stopping_) break;
    const int64_t now = NowNs();
    for (Connection& c : connections_) {
      if (c.done || !c.socket->is_open()) continue;
      const int fd = c.socket->native_handle();
      bool expire = false;
      const int64_t deadline = c.deadline_ns.load(std::memory_order_relaxed);
      if (deadline != 0 && now > deadline) expire = true;
      if (expire && !c.timed_out.exchange(true)) ::shutdown(fd, SHUT_RDWR);
    }
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

template <typename BounceFor>
Status TcpServer::ServeGpuRead(asio::ip::tcp::socket& socket, const wire::FrameHeader& h,
                               int device, BounceFor& bounce_for, asio::error_code& ec) {
  // The first chunk is copied before the header goes out, so a bad device range is refused
  // with a reply; later chunks are copied while the one before is being sent.
  auto bounce = bounce_for(device);
  Status first = bounce.status();
  const uint64_t n0 = std::min<uint64_t>(kBounceBytes, h.length);
  if (first.ok()) first = (*bounce)->StartFromDevice(0, reinterpret_cast<const void*>(h.addr), n0);
  if (first.ok()) first = (*bounce)->Wait(0);
  if (!first.ok()) {
    return WriteReply(socket, wire::FrameType::kReadData, h.request_id,
                      first.WithContext("READ from GPU memory"));
  }
  wire::FrameHeader r;
  r.type = wire::FrameType::kReadData;
  r.request_id = h.request_id;
  r.length = h.length;
  wire::HeaderBytes hb = wire::EncodeFrameHeader(r);
  asio::write(socket, asio::buffer(hb), ec);
  int cur = 0;
  for (uint64_t done = 0; done < h.length && !ec;) {
    const uint64_t n = std::min<uint64_t>(kBounceBytes, h.length - done);
    if (Status w = (*bounce)->Wait(cur); !w.ok()) {
      // The header promised bytes that cannot come: the connection must go.
      return w.WithContext("READ from GPU memory");
    }
    const uint64_t next = done + n;
    const int other = (cur + 1) % kBounceBuffers;
    if (next < h.length) {
      const uint64_t m = std::min<uint64_t>(kBounceBytes, h.length - next);
      RETURN_IF_ERROR((*bounce)
                          ->StartFromDevice(other, reinterpret_cast<const void*>(h.addr + next), m)
                          .WithContext("READ from GPU memory"));
    }
    asio::write(socket, asio::buffer((*bounce)->host(cur), n), ec);
    done = next;
    cur = other;
  }
  if (ec) {
    // The next chunk's copy may still be reading the region: it must end before the caller's
    // pin does (no acknowledgement owns these buffers: they all went out before this reply).
    for (int b = 0; b < kBounceBuffers; ++b) (void)(*bounce)->Wait(b);
    return UnavailableError(ec.message());
  }
  return OkStatus();
}

StatusOr<SegmentDescriptor> TcpServer::Handshake(Connection& connection,
                                                 std::optional<HandshakeRefusal>* refusal) {
  asio::ip::tcp::socket& socket = *connection.socket;
  const std::string& secret = options_.auth_secret;
  asio::error_code ec;
  auto gone = [] { return UnavailableError(""); };  // the client closed: nothing to report
  auto refuse = [refusal](const std::string& why) {
    *refusal = HandshakeRefusal::kProtocol;
    return PermissionDeniedError(why);
  };
  // HELLO: a fixed-size body, read only once the header says so.
  auto header = ReadHeader(socket, options_.max_body_bytes, ec);
  if (ec) return gone();
  if (!header.ok()) return refuse("malformed frame: " + header.status().message());
  if (header->type != wire::FrameType::kHello) {
    return refuse("first frame is " + std::string(wire::FrameTypeName(header->type)) +
                  ", not HELLO");
  }
  if (header->body_bytes != wire::kAuthHelloBytes) {
    return refuse("HELLO body of " + std::to_string(header->body_bytes) + " bytes, want " +
                  std::to_string(wire::kAuthHelloBytes));
  }
  std::array<uint8_t, wire::kAuthHelloBytes> hello_body;
  asio::read(socket, asio::buffer(hello_body), ec);
  if (ec) return gone();
  auto hello = wire::DecodeAuthHello(hello_body);
  if (!hello.ok()) return refuse(hello.status().message());
  // CHALLENGE: this side's nonce and proof; the only answer before the client proved itself.
  wire::AuthChallenge challenge;
  challenge.flags = secret.empty() ? 0 : wire::kAuthFlagSecret;
  auto nonce = RandomAuthNonce();
  if (!nonce.ok()) return nonce.status();
  challenge.server_nonce = *nonce;
  challenge.server_proof = HandshakeProof(secret, AuthContext::kEngine, AuthRole::kServer,
                                          hello->client_nonce, challenge.server_nonce);
  auto challenge_body = wire::EncodeAuthChallenge(challenge);
  wire::FrameHeader out;
  out.type = wire::FrameType::kChallenge;
  out.request_id = header->request_id;
  out.body_bytes = static_cast<uint32_t>(challenge_body.size());
  wire::HeaderBytes hb = wire::EncodeFrameHeader(out);
  asio::write(socket,
              std::array<asio::const_buffer, 2>{asio::buffer(hb), asio::buffer(challenge_body)},
              ec);
  if (ec) return gone();
  // AUTH: the client's proof first; its descriptor is read only once the proof holds. A client
  // that hangs up now found this side's proof wrong: it holds another secret, or none.
  header = ReadHeader(socket, options_.max_body_bytes, ec);
  if (ec) {
    *refusal = HandshakeRefusal::kAuth;
    return gone();
  }
  if (!header.ok()) return refuse("malformed frame: " + header.status().message());
  if (header->type != wire::FrameType::kAuth) {
    return refuse("second frame is " + std::string(wire::FrameTypeName(header->type)) +
                  ", not AUTH");
  }
  if (header->body_bytes < kAuthProofBytes) {
    return refuse("AUTH body of " + std::to_string(header->body_bytes) + " bytes holds no proof");
  }
  AuthProof proof;
  asio::read(socket, asio::buffer(proof), ec);
  if (ec) return gone();
  const AuthProof want = HandshakeProof(secret, AuthContext::kEngine, AuthRole::kClient,
                                        hello->client_nonce, challenge.server_nonce);
  if (!ProofMatches(proof, want)) {
    const bool client_has = (hello->flags & wire::kAuthFlagSecret) != 0;
    *refusal = HandshakeRefusal::kAuth;
    return PermissionDeniedError(std::string("wrong proof of the shared secret (the client ") +
                                 (client_has ? "holds" : "holds no") + " secret, this engine " +
                                 (secret.empty() ? "none" : "one") + ")");
  }
  std::vector<uint8_t> body(header->body_bytes - kAuthProofBytes);
  asio::read(socket, asio::buffer(body), ec);
  if (ec) return gone();
  auto desc = wire::DecodeDescriptor(body);
  if (!desc.ok()) {
    // The client proved the secret: it is told why.
    WriteReply(socket, wire::FrameType::kHelloAck, header->request_id, desc.status()).IgnoreError();
    *refusal = HandshakeRefusal::kProtocol;
    return InvalidArgumentError("bad descriptor in AUTH: " + desc.status().message());
  }
  {
    // Served as authenticated from before the client hears so, unless the accept thread
    // crowded the connection out meanwhile (its reads would fail next).
    std::lock_guard<std::mutex> lock(mu_);
    if (connection.crowded_out.load()) return gone();
    connection.authenticated = true;
    // Counted before the client is told, so that a client's success is already counted.
    counters_.handshakes_completed.fetch_add(1, std::memory_order_relaxed);
  }
  std::vector<uint8_t> mine = wire::EncodeDescriptor(options_.describe());
  if (!WriteReply(socket, wire::FrameType::kHelloAck, header->request_id, OkStatus(), &mine).ok()) {
    return gone();
  }
  return desc;
}

void TcpServer::Serve(Connection* connection) {
  asio::ip::tcp::socket& socket = *connection->socket;
  std::string peer_endpoint;
  {
    asio::error_code ec;
    auto ep = socket.remote_endpoint(ec);
    peer_endpoint = ec ? "unknown" : ep.address().to_string() + ":" + std::to_string(ep.port());
  }
  std::string close_reason;
  SegmentDescriptor peer;
  bool authenticated = false;
  std::optional<HandshakeRefusal> refusal;
  if (auto handshake = Handshake(*connection, &refusal); handshake.ok()) {
    peer = std::move(*handshake);
    authenticated = true;
  } else {
    close_reason = handshake.status().message();  // empty when the client went away
    // The watchdog's and the accept thread's shutdowns make the handshake's reads fail like a
    // client that went away.
    if (connection->timed_out.load()) refusal = HandshakeRefusal::kTimeout;
    if (connection->crowded_out.load()) {
      refusal.reset();  // counted by the accept thread
      close_reason =
          "closed in its handshake to make room for a newer connection "
          "(max_handshakes or max_connections)";
    }
    if (refusal) {
      counters_.handshakes_refused[static_cast<size_t>(*refusal)].fetch_add(
          1, std::memory_order_relaxed);
    }
  }
  std::vector<uint8_t> body;
  // GPU memory over TCP: payloads pass through pinned bounce buffers, one set per device this
  // connection touches, copied to and from the device asynchronously on their own stream.
  std::map<int, std::unique_ptr<cuda::BounceBuffers>> bounces;
  int next_bounce = 0;
  // Per bounce set, the WRITE (request id) whose copy last started in each buffer, so that a
  // failed copy found by the next WRITE to use the buffer fails the WRITE it belonged to.
  std::map<const cuda::BounceBuffers*, std::array<uint64_t, kBounceBuffers>> copy_owner;
  auto bounce_for = [&](int device) -> StatusOr<cuda::BounceBuffers*> {
    auto& b = bounces[device];
    if (b == nullptr) {
      auto made = cuda::BounceBuffers::Create(device, kBounceBuffers, kBounceBytes);
      if (!made.ok()) {
        bounces.erase(device);
        return made.status();
      }
      b = std::move(*made);
    }
    return b.get();
  };
  // Acknowledgements of WRITEs wait here while more requests are already queued in the socket,
  // then leave in one send: small WRITEs otherwise cost one send() each. They wait for at most
  // kMaxQueuedAcks WRITEs or kAckFlushBytes of payload: a client with a bounded number of bytes
  // in flight (the GPU bounce channel: 16 buffers of 1 MiB) otherwise keeps the socket busy
  // until it runs out, and then waits idle for the acknowledgements. A WRITE into GPU
  // memory is acknowledged only after its last chunk's copy to the device finished (its pin
  // keeps the region registered until then). Replies keep their order: everything queued goes
  // out before any other reply.
  constexpr size_t kMaxQueuedAcks = 64;
  constexpr uint64_t kAckFlushBytes = 1ull << 20;
  struct QueuedAck {
    uint64_t request_id = 0;
    Status error;                           // set when the WRITE failed
    cuda::BounceBuffers* bounce = nullptr;  // GPU WRITE: wait for `buffer`'s copy first
    int buffer = -1;
    MemoryRegistry::Pin pin;  // GPU WRITE: the region, until the copy finished
  };
  std::deque<QueuedAck> queued_acks;
  uint64_t queued_ack_bytes = 0;  // payload bytes of the WRITEs in queued_acks
  auto queue_ack = [&](QueuedAck q, uint64_t payload_bytes) {
    queued_acks.push_back(std::move(q));
    queued_ack_bytes += payload_bytes;
  };
  auto flush_acks = [&]() -> bool {
    if (queued_acks.empty()) return true;
    std::vector<wire::HeaderBytes> headers(queued_acks.size());
    std::deque<std::string> texts;
    std::vector<asio::const_buffer> out;
    for (size_t i = 0; i < queued_acks.size(); ++i) {
      QueuedAck& q = queued_acks[i];
      // Wait even for a failed WRITE: chunks before the failure may still be copying into the
      // region its pin holds. Every buffer whose last copy is this WRITE's is waited for, so
      // that a failed copy is this WRITE's error and not the next user's of the buffer.
      Status st = q.error;
      if (q.bounce != nullptr) {
        auto& owners = copy_owner[q.bounce];
        for (int b = 0; b < kBounceBuffers; ++b) {
          if (owners[b] != q.request_id && b != q.buffer) continue;
          Status w = q.bounce->Wait(b);
          if (st.ok()) st = w;
          owners[b] = 0;
        }
      }
      wire::FrameHeader ack;
      ack.type = wire::FrameType::kWriteAck;
      ack.request_id = q.request_id;
      ack.status = static_cast<uint32_t>(st.code());
      if (!st.ok()) {
        texts.push_back(st.WithContext("WRITE into GPU memory").message());
        ack.body_bytes = static_cast<uint32_t>(texts.back().size());
      }
      headers[i] = wire::EncodeFrameHeader(ack);
      out.push_back(asio::buffer(headers[i]));
      if (!st.ok()) out.push_back(asio::buffer(texts.back()));
    }
    asio::error_code wec;
    asio::write(socket, out, wec);
    queued_acks.clear();  // drops the pins: every copy above finished
    queued_ack_bytes = 0;
    return !wec;
  };
  const int64_t frame_timeout_ns = std::chrono::nanoseconds(options_.frame_timeout).count();
  // The handshake ran under the deadline set at accept; from here a deadline runs only while a
  // frame is under way.
  auto arm = [&](int64_t until_ns) {
    connection->deadline_ns.store(until_ns, std::memory_order_relaxed);
  };
  int64_t frame_start_ns = 0;
  while (authenticated && close_reason.empty()) {
    asio::error_code ec;
    if (!queued_acks.empty() &&
        (queued_acks.size() >= kMaxQueuedAcks || queued_ack_bytes >= kAckFlushBytes ||
         socket.available(ec) == 0 || ec)) {
      if (!flush_acks()) break;
    }
    // Idle between frames: no deadline. Once a header's first bytes arrived, the rest must
    // follow within frame_timeout.
    connection->deadline_ns.store(0, std::memory_order_relaxed);
    auto header = ReadHeaderThen(socket, options_.max_body_bytes, ec, [&] {
      frame_start_ns = NowNs();
      arm(frame_start_ns + frame_timeout_ns);
    });
    if (ec) break;  // peer closed, connection reset, or closed by the watchdog
    if (!header.ok()) {
      close_reason = "malformed frame: " + header.status().message();
      break;
    }
    const wire::FrameHeader& h = *header;
    // The rest of the frame and its answer: frame_timeout plus its bytes at the minimum rate.
    arm(frame_start_ns + frame_timeout_ns +
        static_cast<int64_t>(
            std::min<uint64_t>((h.body_bytes + h.length) / kMinFrameBytesPerSecond, 1u << 20)) *
            1000000000);
    if (h.type != wire::FrameType::kWrite && !flush_acks()) break;
    if (body.capacity() > 4 * kBodyChunkBytes) std::vector<uint8_t>().swap(body);
    body.clear();
    for (uint32_t got = 0; got < h.body_bytes && !ec;) {
      const uint32_t n = std::min<uint32_t>(h.body_bytes - got, kBodyChunkBytes);
      body.resize(got + n);
      asio::read(socket, asio::buffer(body.data() + got, n), ec);
      got += n;
    }
    if (ec) break;
    Status io;
    switch (h.type) {
      case wire::FrameType::kWrite: {
        // A strided WRITE: its rows must all lie in one registered region (the whole extent
        // is checked, so no row lands outside memory the client may write).
        StatusOr<wire::StridedWrite> strided = wire::StridedWrite{};
        uint64_t extent = h.length;
        if ((h.flags & wire::kFlagStrided) != 0) {
          strided = wire::DecodeStridedWrite(body, h.addr, h.length);
          if (strided.ok()) {
            extent = (strided->rows - 1) * strided->remote_stride + strided->row_bytes;
          }
        }
        auto pin = strided.ok() ? registry_->PinRange(h.addr, extent, kAccessRemoteWrite)
                                : StatusOr<MemoryRegistry::Pin>(strided.status());
        if (pin.ok() && strided->rows > 1 && pin->region().kind != MemoryKind::kHost) {
          pin = UnimplementedError(
              "strided WRITE into GPU memory over TCP (send its rows one by one)");
        }
        if (!pin.ok()) {
          Discard(socket, h.length, ec);
          if (ec || !flush_acks()) break;
          io = WriteReply(socket, wire::FrameType::kWriteAck, h.request_id,
                          pin.status().WithContext("WRITE refused"));
          break;
        }
        if (strided->rows > 1) {
          std::vector<asio::mutable_buffer> rows;
          rows.reserve(strided->rows);
          for (uint32_t r = 0; r < strided->rows; ++r) {
            rows.push_back(asio::buffer(
                reinterpret_cast<void*>(h.addr + r * strided->remote_stride), strided->row_bytes));
          }
          ReadAll(socket, rows, ec);
          if (ec) break;
          QueuedAck q;
          q.request_id = h.request_id;
          queue_ack(std::move(q), h.length);
          break;
        }
        if (pin->region().kind == MemoryKind::kCuda) {
          // Chunk by chunk into the bounce buffers, each copied to the device while the next
          // arrives. A failed copy still drains the payload, then fails this WRITE only.
          QueuedAck q;
          q.request_id = h.request_id;
          auto bounce = bounce_for(pin->region().device_id);
          if (!bounce.ok()) q.error = bounce.status();
          for (uint64_t done = 0; done < h.length && !ec;) {
            const uint64_t n = std::min<uint64_t>(kBounceBytes, h.length - done);
            if (!q.error.ok()) {
              Discard(socket, n, ec);
            } else {
              const int i = next_bounce++ % kBounceBuffers;
              uint64_t& owner = copy_owner[*bounce][i];
              if (Status w = (*bounce)->Wait(i); !w.ok()) {
                // The buffer's previous copy failed: the WRITE it belonged to fails, this one
                // or one whose acknowledgement waits (its own wait would now find nothing).
                bool theirs = false;
                for (QueuedAck& a : queued_acks) {
                  if (owner != h.request_id && a.request_id == owner) {
                    if (a.error.ok()) a.error = w;
                    theirs = true;
                  }
                }
                if (!theirs) q.error = w;
              }
              asio::read(socket, asio::buffer((*bounce)->host(i), n), ec);
              if (!ec && q.error.ok()) {
                q.error = (*bounce)->StartToDevice(i, reinterpret_cast<void*>(h.addr + done), n);
                q.bounce = *bounce;
                q.buffer = i;
                owner = h.request_id;
              }
            }
            done += n;
          }
          if (ec) {
            // The copies this WRITE started (one stream: its last one ends after the others)
            // must end before its pin does.
            if (q.bounce != nullptr) (void)q.bounce->Wait(q.buffer);
            break;
          }
          q.pin = std::move(*pin);
          queue_ack(std::move(q), h.length);
          break;
        }
        asio::read(socket, asio::buffer(reinterpret_cast<void*>(h.addr), h.length), ec);
        if (ec) break;
        QueuedAck q;
        q.request_id = h.request_id;
        queue_ack(std::move(q), h.length);
        break;
      }
      case wire::FrameType::kRead: {
        auto pin = registry_->PinRange(h.addr, h.length, kAccessRemoteRead);
        Status refuse = pin.ok() ? OkStatus() : pin.status().WithContext("READ refused");
        if (!refuse.ok()) {
          io = WriteReply(socket, wire::FrameType::kReadData, h.request_id, refuse);
          break;
        }
        if (pin->region().kind == MemoryKind::kCuda) {
          io = ServeGpuRead(socket, h, pin->region().device_id, bounce_for, ec);
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
  if (close_reason.empty() && connection->timed_out.load()) {
    close_reason = authenticated ? "a frame did not arrive or leave in time (frame_timeout)"
                                 : "no handshake in time (handshake_timeout)";
  }
  if (!close_reason.empty()) {
    KVF_LOG_WARN_LIMITED("closing connection from {} ({}): {}", peer_endpoint,
                         peer.name.empty() ? "not authenticated" : peer.name, close_reason);
  }
  asio::error_code ignored;
  socket.shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
  std::lock_guard<std::mutex> lock(mu_);
  connection->done = true;
  counters_.connections_open.fetch_sub(1, std::memory_order_relaxed);
}

}  // namespace kvferry::tcp
