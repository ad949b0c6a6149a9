#include "transport/tcp/tcp_common.h"

#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
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
}

namespace {
void SetReceiveTimeout(asio::ip::tcp::socket& socket, std::chrono::milliseconds timeout) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
  ::setsockopt(socket.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(socket.native_handle(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}
}  // namespace

Status ConnectAndHello(asio::ip::tcp::socket& socket, const std::string& address,
                       const SegmentDescriptor& self, std::chrono::milliseconds timeout,
                       uint32_t max_body_bytes, SegmentDescriptor* peer) {
  ASSIGN_OR_RETURN(HostPort endpoint, ParseHostPort(address, "peer address"));
  const std::string& host = endpoint.host;
  const uint16_t port = endpoint.port;
  auto fail = [&](const std::string& why) {
    asio::error_code ignored;
    socket.close(ignored);
    return UnavailableError("cannot reach peer " + address + ": " + why);
  };
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
  // Connect asynchronously so the timeout bounds it, then continue with blocking I/O.
  asio::io_context& io = static_cast<asio::io_context&>(socket.get_executor().context());
  asio::error_code connect_ec = asio::error::timed_out;
  asio::async_connect(
      socket, endpoints,
      [&](const asio::error_code& e, const asio::ip::tcp::endpoint&) { connect_ec = e; });
  io.restart();
  io.run_for(timeout);
  if (!io.stopped()) {
    socket.close(ec);
    io.run();  // let the cancelled handler run
    return fail("connect timed out after " + std::to_string(timeout.count()) + " ms");
  }
  if (connect_ec) return fail("connect: " + connect_ec.message());
  TuneSocket(socket);
  SetReceiveTimeout(socket, timeout);

  std::vector<uint8_t> body = wire::EncodeDescriptor(self);
  wire::FrameHeader hello;
  hello.type = wire::FrameType::kHello;
  hello.body_bytes = static_cast<uint32_t>(body.size());
  wire::HeaderBytes hb = wire::EncodeFrameHeader(hello);
  std::array<asio::const_buffer, 2> out{asio::buffer(hb), asio::buffer(body)};
  asio::write(socket, out, ec);
  if (ec) return fail("handshake send: " + ec.message());
  auto header = ReadHeader(socket, max_body_bytes, ec);
  if (ec) return fail("handshake receive: " + ec.message());
  if (!header.ok()) return fail("handshake: " + header.status().message());
  if (header->type != wire::FrameType::kHelloAck) {
    return fail(std::string("handshake: expected HELLO_ACK, got ") +
                std::string(wire::FrameTypeName(header->type)));
  }
  std::vector<uint8_t> reply(header->body_bytes);
  asio::read(socket, asio::buffer(reply), ec);
  if (ec) return fail("handshake body: " + ec.message());
  if (header->status != 0) {
    return fail("handshake refused: " + std::string(reply.begin(), reply.end()));
  }
  auto desc = wire::DecodeDescriptor(reply);
  if (!desc.ok()) return fail("handshake: " + desc.status().message());
  *peer = std::move(*desc);
  SetReceiveTimeout(socket, std::chrono::milliseconds(0));  // 0 = block without limit
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
void TransferAll(int fd, std::vector<iovec>& iov, Op op, bool reading, asio::error_code& ec) {
  size_t first = 0;
  const size_t max_iov = static_cast<size_t>(IOV_MAX);
  while (first < iov.size()) {
    const int n = static_cast<int>(std::min(max_iov, iov.size() - first));
    const ssize_t done = op(fd, iov.data() + first, n);
    if (done < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        // asio may have put the descriptor in non-blocking mode: wait until it is ready.
        pollfd p{fd, static_cast<short>(reading ? POLLIN : POLLOUT), 0};
        if (::poll(&p, 1, -1) < 0 && errno != EINTR) {
          ec = asio::error_code(errno, asio::error::get_system_category());
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
              asio::error_code& ec) {
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
      false, ec);
}

void ReadAll(asio::ip::tcp::socket& socket, std::span<const asio::mutable_buffer> buffers,
             asio::error_code& ec) {
  std::vector<iovec> iov;
  iov.reserve(buffers.size());
  for (const auto& b : buffers) {
    if (b.size() > 0) iov.push_back({b.data(), b.size()});
  }
  TransferAll(
      socket.native_handle(), iov, [](int fd, const iovec* v, int n) { return ::readv(fd, v, n); },
      true, ec);
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
