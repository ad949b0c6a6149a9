#include "transport/tcp/tcp_common.h"

#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <vector>

#include "common/checks.h"
#include "common/host_port.h"

namespace kvferry::tcp {

void TuneSocket(asio::ip::tcp::socket& socket) {
  asio::error_code ec;
  socket.set_option(asio::ip::tcp::no_delay(true), ec);
  // A peer that vanished without closing (power loss, a partition) is found by keepalive
  // probes: 30 s idle, then 4 probes 5 s apart. Without them its connections (on the serving
  // side, their threads and a place under max_connections) wait for bytes forever.
  socket.set_option(asio::socket_base::keep_alive(true), ec);
  const int fd = socket.native_handle();
  const int idle_s = 30, interval_s = 5, probes = 4;
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval_s, sizeof(interval_s));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
}

Status ConnectAndHello(asio::ip::tcp::socket& socket, const std::string& address,
                       const SegmentDescriptor& self, const std::string& auth_secret,
                       std::chrono::milliseconds timeout, uint32_t max_body_bytes,
                       SegmentDescriptor* peer, const SocketGuard& guard) {
  ASSIGN_OR_RETURN(HostPort endpoint, ParseHostPort(address, "peer address"));
  const std::string& host = endpoint.host;
  const uint16_t port = endpoint.port;
  auto fail = [&](const std::string& why) {
    return UnavailableError("cannot reach peer " + address + ": " + why);
  };
  auto guarded = [&](const std::function<void()>& op) { return guard ? guard(op) : (op(), true); };
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  asio::error_code ec;
  asio::ip::address ip = asio::ip::make_address(host, ec);
  std::vector<asio::ip::tcp::endpoint> endpoints;
  if (!ec) {
    endpoints.emplace_back(ip, port);
  } else {
    asio::io_context io;
    asio::ip::tcp::resolver resolver(io);
    auto results = resolver.resolve(host, std::to_string(port), ec);
    if (ec) return fail("resolve: " + ec.message());
    for (const auto& r : results) endpoints.push_back(r.endpoint());
  }
  // One address at a time, each connect asynchronous so the deadline bounds it, then blocking
  // I/O on the one that answered.
  asio::io_context& io = static_cast<asio::io_context&>(socket.get_executor().context());
  asio::error_code last = asio::error::host_not_found;
  bool connected = false;
  for (const asio::ip::tcp::endpoint& ep : endpoints) {
    asio::error_code open_ec;
    const bool go = guarded([&] {
      asio::error_code ignored;
      if (socket.is_open()) socket.close(ignored);
      socket.open(ep.protocol(), open_ec);
    });
    if (!go) return fail("connect abandoned");
    if (open_ec) {
      last = open_ec;
      continue;
    }
    asio::error_code connect_ec = asio::error::timed_out;
    socket.async_connect(ep, [&](const asio::error_code& e) { connect_ec = e; });
    io.restart();
    io.run_until(deadline);
    if (!io.stopped()) {
      socket.cancel(ec);
      io.run();  // the cancelled connect's handler, at once
      return fail("connect timed out after " + std::to_string(timeout.count()) + " ms");
    }
    if (!connect_ec) {
      connected = true;
      break;
    }
    last = connect_ec;
  }
  if (!connected) return fail("connect: " + last.message());
  if (!guarded([] {})) return fail("connect abandoned");
  TuneSocket(socket);
  return ClientHandshake(socket, address, self, auth_secret, max_body_bytes, peer, deadline);
}

Status ClientHandshake(asio::ip::tcp::socket& socket, const std::string& address,
                       const SegmentDescriptor& self, const std::string& auth_secret,
                       uint32_t max_body_bytes, SegmentDescriptor* peer,
                       std::chrono::steady_clock::time_point deadline) {
  auto fail = [&](const std::string& why) {
    return UnavailableError("cannot reach peer " + address + ": " + why);
  };
  asio::error_code ec;
  // Every read and write below waits on the descriptor for what is left of the deadline (a
  // peer that accepted but does not answer, e.g. a frozen process, must not hold the caller).
  socket.native_non_blocking(true, ec);
  if (ec) return fail("handshake: " + ec.message());
  auto io_failed = [&](const char* what) {
    return fail(std::string(what) + ": " +
                (ec == asio::error::timed_out ? std::string("no answer in time") : ec.message()));
  };
  // Reads the next frame's header and body, which must be of `type`; the body at most
  // `max_body` bytes.
  auto read_frame = [&](wire::FrameType type, uint32_t max_body, std::vector<uint8_t>* body,
                        wire::FrameHeader* header) -> Status {
    wire::HeaderBytes header_bytes;
    asio::mutable_buffer header_buffer = asio::buffer(header_bytes);
    ReadAll(socket, std::span(&header_buffer, 1), ec, deadline);
    if (ec) return io_failed("handshake receive");
    auto h = wire::DecodeFrameHeader(header_bytes, max_body_bytes);
    if (!h.ok()) return fail("handshake: " + h.status().message());
    if (h->type != type) {
      return fail("handshake: expected " + std::string(wire::FrameTypeName(type)) + ", got " +
                  std::string(wire::FrameTypeName(h->type)));
    }
    if (h->body_bytes > max_body) {
      return fail("handshake: " + std::string(wire::FrameTypeName(type)) + " body of " +
                  std::to_string(h->body_bytes) + " bytes");
    }
    body->resize(h->body_bytes);
    asio::mutable_buffer body_buffer = asio::buffer(*body);
    ReadAll(socket, std::span(&body_buffer, 1), ec, deadline);
    if (ec) return io_failed("handshake body");
    *header = *h;
    return OkStatus();
  };

  wire::AuthHello hello;
  hello.flags = auth_secret.empty() ? 0 : wire::kAuthFlagSecret;
  auto nonce = RandomAuthNonce();
  if (!nonce.ok()) return nonce.status();
  hello.client_nonce = *nonce;
  auto hello_body = wire::EncodeAuthHello(hello);
  wire::FrameHeader h;
  h.type = wire::FrameType::kHello;
  h.body_bytes = static_cast<uint32_t>(hello_body.size());
  wire::HeaderBytes hb = wire::EncodeFrameHeader(h);
  const std::array<asio::const_buffer, 2> hello_frame{asio::buffer(hb), asio::buffer(hello_body)};
  WriteAll(socket, hello_frame, ec, deadline);
  if (ec) return io_failed("handshake send");

  std::vector<uint8_t> body;
  wire::FrameHeader reply;
  RETURN_IF_ERROR(
      read_frame(wire::FrameType::kChallenge, wire::kAuthChallengeBytes, &body, &reply));
  auto challenge = wire::DecodeAuthChallenge(body);
  if (!challenge.ok()) return fail("handshake: " + challenge.status().message());
  const AuthProof server_proof =
      HandshakeProof(auth_secret, AuthContext::kEngine, AuthRole::kServer, hello.client_nonce,
                     challenge->server_nonce);
  if (!ProofMatches(challenge->server_proof, server_proof)) {
    const bool peer_has = (challenge->flags & wire::kAuthFlagSecret) != 0;
    std::string why = peer_has && auth_secret.empty() ? "it holds an auth secret and this engine "
                                                        "has none (set KVFERRY_AUTH_TOKEN or "
                                                        "--auth-token-file)"
                      : !peer_has && !auth_secret.empty()
                          ? "it holds no auth secret and this engine holds one"
                          : "the auth secrets differ";
    return PermissionDeniedError("peer " + address + " failed to prove the shared secret: " + why);
  }

  const AuthProof client_proof =
      HandshakeProof(auth_secret, AuthContext::kEngine, AuthRole::kClient, hello.client_nonce,
                     challenge->server_nonce);
  std::vector<uint8_t> descriptor = wire::EncodeDescriptor(self);
  h = wire::FrameHeader{};
  h.type = wire::FrameType::kAuth;
  h.body_bytes = static_cast<uint32_t>(client_proof.size() + descriptor.size());
  hb = wire::EncodeFrameHeader(h);
  const std::array<asio::const_buffer, 3> auth_frame{asio::buffer(hb), asio::buffer(client_proof),
                                                     asio::buffer(descriptor)};
  WriteAll(socket, auth_frame, ec, deadline);
  if (ec) return io_failed("handshake send");

  RETURN_IF_ERROR(read_frame(wire::FrameType::kHelloAck, max_body_bytes, &body, &reply));
  if (reply.status != 0) {
    return fail("handshake refused: " + std::string(body.begin(), body.end()));
  }
  auto desc = wire::DecodeDescriptor(body);
  if (!desc.ok()) return fail("handshake: " + desc.status().message());
  *peer = std::move(*desc);
  return OkStatus();
}

StatusOr<wire::FrameHeader> ReadHeader(asio::ip::tcp::socket& socket, uint32_t max_body_bytes,
                                       asio::error_code& ec) {
  wire::HeaderBytes bytes;
  asio::read(socket, asio::buffer(bytes), ec);
  if (ec) return UnavailableError(ec.message());
  return wire::DecodeFrameHeader(bytes, max_body_bytes);
}

namespace {

// Moves every byte of `iov` with `op` (readv or sendmsg), retrying after signals and partial
// transfers; `iov` is consumed in place.
template <typename Op>
void TransferAll(int fd, std::vector<iovec>& iov, Op op, bool reading, asio::error_code& ec,
                 std::chrono::steady_clock::time_point deadline) {
  size_t first = 0;
  const size_t max_iov = static_cast<size_t>(IOV_MAX);
  while (first < iov.size()) {
    const int n = static_cast<int>(std::min(max_iov, iov.size() - first));
    const ssize_t done = op(fd, iov.data() + first, n);
    if (done < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        // asio may have put the descriptor in non-blocking mode: wait until it is ready, or
        // until the deadline.
        int wait_ms = -1;
        if (deadline != std::chrono::steady_clock::time_point::max()) {
          const auto left = deadline - std::chrono::steady_clock::now();
          wait_ms = static_cast<int>(std::clamp<int64_t>(
              std::chrono::ceil<std::chrono::milliseconds>(left).count(), 0, INT_MAX));
        }
        pollfd p{fd, static_cast<short>(reading ? POLLIN : POLLOUT), 0};
        const int ready = ::poll(&p, 1, wait_ms);
        if (ready < 0 && errno != EINTR) {
          ec = asio::error_code(errno, asio::error::get_system_category());
          return;
        }
        if (ready == 0) {
          ec = asio::error::timed_out;
          return;
        }
        continue;
      }
      ec = asio::error_code(errno, asio::error::get_system_category());
      return;
    }
    if (done == 0 && reading) {
      ec = asio::error::eof;
      return;
    }
    size_t left = static_cast<size_t>(done);
    while (first < iov.size() && left >= iov[first].iov_len) {
      left -= iov[first].iov_len;
      ++first;
    }
    if (left > 0) {  // first is mid-buffer: left < its length (no empty buffers in `iov`)
      iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
}

}  // namespace

void WriteAll(asio::ip::tcp::socket& socket, std::span<const asio::const_buffer> buffers,
              asio::error_code& ec, std::chrono::steady_clock::time_point deadline) {
  std::vector<iovec> iov;
  iov.reserve(buffers.size());
  for (const auto& b : buffers) {
    if (b.size() > 0) iov.push_back({const_cast<void*>(b.data()), b.size()});
  }
  // sendmsg with MSG_NOSIGNAL, not writev: a peer that died must not raise SIGPIPE here.
  TransferAll(
      socket.native_handle(), iov,
      [](int fd, const iovec* v, int n) {
        msghdr m{};
        m.msg_iov = const_cast<iovec*>(v);
        m.msg_iovlen = static_cast<size_t>(n);
        return ::sendmsg(fd, &m, MSG_NOSIGNAL);
      },
      false, ec, deadline);
}

void ReadAll(asio::ip::tcp::socket& socket, std::span<const asio::mutable_buffer> buffers,
             asio::error_code& ec, std::chrono::steady_clock::time_point deadline) {
  std::vector<iovec> iov;
  iov.reserve(buffers.size());
  for (const auto& b : buffers) {
    if (b.size() > 0) iov.push_back({b.data(), b.size()});
  }
  TransferAll(
      socket.native_handle(), iov, [](int fd, const iovec* v, int n) { return ::readv(fd, v, n); },
      true, ec, deadline);
}

void Discard(asio::ip::tcp::socket& socket, uint64_t n, asio::error_code& ec) {
  std::vector<uint8_t> scratch(std::min<uint64_t>(n, 256 << 10));
  while (n > 0 && !ec) {
    size_t chunk = static_cast<size_t>(std::min<uint64_t>(n, scratch.size()));
    asio::read(socket, asio::buffer(scratch.data(), chunk), ec);
    n -= chunk;
  }
}

}  // namespace kvferry::tcp
