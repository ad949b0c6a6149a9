// Helpers shared by the TCP client and server: connect with a timeout, the client's side of the
// authenticated handshake (wire.h), and framed reads.
#pragma once

#include <asio.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "kvferry/segment.h"
#include "kvferry/status.h"
#include "transport/tcp/wire.h"

namespace kvferry::tcp {

// Runs `op`, which opens or closes the socket, under its owner's lock, and returns true; or
// returns false without running it when the owner gave up on the connection (another thread
// failed it, and may be shutting the socket down under that lock). Empty: `op` runs directly.
using SocketGuard = std::function<bool(const std::function<void()>& op)>;

// Connects to each address `address` resolves to in turn until one answers, then performs the
// handshake (ClientHandshake). Blocks at most `timeout` in all: the connect (every address)
// and the handshake share one deadline. Every open and close of `socket` here runs through
// `guard`; the socket is never closed on an error: its owner closes it. Errors: those of
// ClientHandshake; kUnavailable when no address answers in time or `guard` refused (the owner gave
// up).
Status ConnectAndHello(asio::ip::tcp::socket& socket, const std::string& address,
                       const SegmentDescriptor& self, const std::string& auth_secret,
                       std::chrono::milliseconds timeout, uint32_t max_body_bytes,
                       SegmentDescriptor* peer, const SocketGuard& guard = {});

// The client's side of the handshake on a connected `socket` to `address`: sends HELLO with a
// fresh nonce, checks the server's proof of `auth_secret` in its CHALLENGE (empty: the proof of
// no secret), answers with its own proof and `self`, and reads the server's descriptor from
// HELLO_ACK into `peer`, all before `deadline` (the socket is left non-blocking, as asio's
// asynchronous connect leaves it). Errors: kPermissionDenied when the server did not prove the
// secret (its claim to hold one or not is named), kUnavailable for I/O errors, no answer by the
// deadline, a malformed answer or a refused HELLO.
Status ClientHandshake(asio::ip::tcp::socket& socket, const std::string& address,
                       const SegmentDescriptor& self, const std::string& auth_secret,
                       uint32_t max_body_bytes, SegmentDescriptor* peer,
                       std::chrono::steady_clock::time_point deadline);

// Sets TCP_NODELAY and keepalive probes (a silent peer is found within about 50 s of
// idleness); failures are ignored.
void TuneSocket(asio::ip::tcp::socket& socket);

// Reads one header (blocking). Returns the asio error on I/O failure through `ec`; a decode
// failure through the returned status with `ec` clear.
StatusOr<wire::FrameHeader> ReadHeader(asio::ip::tcp::socket& socket, uint32_t max_body_bytes,
                                       asio::error_code& ec);

// Like ReadHeader, but calls `started()` as soon as the header's first bytes arrived, before
// waiting for the rest (the serving side starts a frame's deadline there). One read when the
// whole header is already in the socket.
template <typename Started>
StatusOr<wire::FrameHeader> ReadHeaderThen(asio::ip::tcp::socket& socket, uint32_t max_body_bytes,
                                           asio::error_code& ec, Started started) {
  wire::HeaderBytes bytes;
  const size_t got = socket.read_some(asio::buffer(bytes), ec);
  if (ec) return UnavailableError(ec.message());
  started();
  if (got < bytes.size()) {
    asio::read(socket, asio::buffer(bytes.data() + got, bytes.size() - got), ec);
    if (ec) return UnavailableError(ec.message());
  }
  return wire::DecodeFrameHeader(bytes, max_body_bytes);
}

// Writes every byte of `buffers`, up to IOV_MAX buffers per sendmsg (MSG_NOSIGNAL): asio
// passes at most 64 per call, which for the 1 KiB rows of a strided frame meant a system call
// per 64 KiB. Partial writes continue where they stopped. Errors through `ec`.
// With a `deadline`, a non-blocking socket waits for at most what is left of it, then fails
// with asio::error::timed_out (a blocking one waits in the system call, unbounded).
void WriteAll(
    asio::ip::tcp::socket& socket, std::span<const asio::const_buffer> buffers,
    asio::error_code& ec,
    std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max());
// Fills every byte of `buffers`, up to IOV_MAX buffers per readv; `deadline` as for WriteAll.
void ReadAll(
    asio::ip::tcp::socket& socket, std::span<const asio::mutable_buffer> buffers,
    asio::error_code& ec,
    std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max());

// Reads `n` bytes and throws them away.
void Discard(asio::ip::tcp::socket& socket, uint64_t n, asio::error_code& ec);

}  // namespace kvferry::tcp
