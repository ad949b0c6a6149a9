#include "transport/nvlink/fd_passing.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>

#include "common/auth.h"
#include "common/logging.h"

namespace kvferry {
namespace {

socklen_t AbstractAddress(const std::string& name, sockaddr_un* addr) {
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  size_t n = std::min(name.size(), sizeof(addr->sun_path) - 2);
  std::memcpy(addr->sun_path + 1, name.data(), n);  // sun_path[0] = 0: abstract namespace
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

using Clock = std::chrono::steady_clock;

// Waits until `fd` is ready for `events` or `deadline` passed; false on the deadline or an
// error.
bool WaitReady(int fd, short events, Clock::time_point deadline) {
  while (true) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, static_cast<int>(left));  // left <= kRequestTime
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) return false;
  }
}

// Reads exactly n bytes before `deadline` (the whole exchange's, not one read's: a peer that
// trickles bytes cannot stretch it).
bool ReadAll(int fd, void* buf, size_t n, Clock::time_point deadline) {
  auto* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    if (!WaitReady(fd, POLLIN, deadline)) return false;
    ssize_t r = ::recv(fd, p, n, MSG_DONTWAIT);
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool WriteAll(int fd, const void* buf, size_t n, Clock::time_point deadline) {
  const auto* p = static_cast<const uint8_t*>(buf);
  while (n > 0) {
    if (!WaitReady(fd, POLLOUT, deadline)) return false;
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// How long the server gives one connection for its whole exchange, and the client its request
// (connecting included).
constexpr std::chrono::seconds kServeTime{2};
constexpr std::chrono::seconds kRequestTime{5};
// What the server's answer may take after the provider ran, whatever is left of kServeTime.
constexpr std::chrono::milliseconds kAnswerTime{500};

// The client's opening: its nonce, then the key.
constexpr size_t kRequestBytes = kAuthNonceBytes + 8;
// The server's challenge: its nonce, then its proof.
constexpr size_t kChallengeBytes = kAuthNonceBytes + kAuthProofBytes;

}  // namespace

StatusOr<std::unique_ptr<FdServer>> FdServer::Create(const std::string& name,
                                                     const std::string& auth_secret,
                                                     Provider provider) {
  std::unique_ptr<FdServer> s(new FdServer());
  s->name_ = name;
  s->auth_secret_ = auth_secret;
  s->provider_ = std::move(provider);
  s->listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s->listen_fd_ < 0)
    return UnavailableError("fd server socket: " + std::string(strerror(errno)));
  sockaddr_un addr;
  socklen_t len = AbstractAddress(name, &addr);
  if (::bind(s->listen_fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      ::listen(s->listen_fd_, 64) != 0) {
    return UnavailableError("fd server '" + name + "': " + std::string(strerror(errno)));
  }
  FdServer* raw = s.get();
  s->thread_ = std::thread([raw] { raw->Loop(); });
  return s;
}

FdServer::~FdServer() {
  stopping_ = true;
  if (listen_fd_ >= 0) ::shutdown(listen_fd_, SHUT_RDWR);
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

void FdServer::Loop() {
  while (!stopping_) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    int c = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) continue;
    // One connection at a time, each with kServeTime for all of it: a client that connects
    // and trickles bytes holds the server no longer than that.
    const std::string refused = Serve(c, Clock::now() + kServeTime);
    if (uint64_t dropped = 0; !refused.empty() && refused_log_.Allow(&dropped)) {
      KVF_LOG_WARN(
          "fd server '{}': refused a request: {}{}", name_, refused,
          dropped > 0 ? " (" + std::to_string(dropped) + " more refusals not logged)" : "");
    }
    ::close(c);
  }
}

std::string FdServer::Serve(int c, std::chrono::steady_clock::time_point deadline) {
  std::array<uint8_t, kRequestBytes> request;
  if (!ReadAll(c, request.data(), request.size(), deadline)) return "";  // went away or too slow
  AuthNonce client_nonce;
  std::copy(request.begin(), request.begin() + kAuthNonceBytes, client_nonce.begin());
  uint64_t key = 0;
  for (int i = 0; i < 8; ++i) key |= static_cast<uint64_t>(request[kAuthNonceBytes + i]) << (8 * i);
  auto server_nonce = RandomAuthNonce();
  if (!server_nonce.ok()) return server_nonce.status().message();
  const AuthProof server_proof = HandshakeProof(auth_secret_, AuthContext::kFdSocket,
                                                AuthRole::kServer, client_nonce, *server_nonce);
  std::array<uint8_t, kChallengeBytes> challenge;
  std::copy(server_nonce->begin(), server_nonce->end(), challenge.begin());
  std::copy(server_proof.begin(), server_proof.end(), challenge.begin() + kAuthNonceBytes);
  if (!WriteAll(c, challenge.data(), challenge.size(), deadline)) return "";
  AuthProof client_proof;
  if (!ReadAll(c, client_proof.data(), client_proof.size(), deadline)) return "";
  const AuthProof want = HandshakeProof(auth_secret_, AuthContext::kFdSocket, AuthRole::kClient,
                                        client_nonce, *server_nonce);
  if (!ProofMatches(client_proof, want)) return "wrong proof of the shared secret";
  const auto provide_start = std::chrono::steady_clock::now();
  StatusOr<int> fd = provider_(key);
  KVF_LOG_DEBUG(
      "fd server '{}': key {:x} {} in {:.1f} ms", name_, key, fd.ok() ? "exported" : "refused",
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - provide_start)
          .count());
  uint8_t status = fd.ok() ? 0 : 1;
  iovec iov{&status, 1};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd.ok()) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(cm), &*fd, sizeof(int));
  }
  // The answer gets a short time of its own: a provider that ran long (the driver, the
  // registry's lock) must not cost the client an answer it is waiting for.
  const Clock::time_point answer_by = std::max(deadline, Clock::now() + kAnswerTime);
  if (WaitReady(c, POLLOUT, answer_by)) (void)!::sendmsg(c, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (fd.ok()) ::close(*fd);
  return "";
}

StatusOr<int> RequestFd(const std::string& name, uint64_t key, const std::string& auth_secret) {
  int c = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (c < 0) return UnavailableError("socket: " + std::string(strerror(errno)));
  std::unique_ptr<int, void (*)(int*)> guard(&c, [](int* f) { ::close(*f); });
  sockaddr_un addr;
  socklen_t len = AbstractAddress(name, &addr);
  const Clock::time_point deadline = Clock::now() + kRequestTime;
  // Before connect: a Unix socket's connect waits while the server's backlog is full, for up
  // to the send timeout (without one, for ever).
  timeval tv{kRequestTime.count(), 0};
  ::setsockopt(c, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  if (::connect(c, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    return UnavailableError("cannot reach fd server '" + name + "': " + strerror(errno));
  }
  auto client_nonce = RandomAuthNonce();
  if (!client_nonce.ok()) return client_nonce.status();
  std::array<uint8_t, kRequestBytes> request;
  std::copy(client_nonce->begin(), client_nonce->end(), request.begin());
  for (int i = 0; i < 8; ++i) request[kAuthNonceBytes + i] = static_cast<uint8_t>(key >> (8 * i));
  if (!WriteAll(c, request.data(), request.size(), deadline)) {
    return UnavailableError("fd request to '" + name + "' failed to send");
  }
  std::array<uint8_t, kChallengeBytes> challenge;
  if (!ReadAll(c, challenge.data(), challenge.size(), deadline)) {
    return UnavailableError("fd server '" + name + "' sent no challenge");
  }
  AuthNonce server_nonce;
  std::copy(challenge.begin(), challenge.begin() + kAuthNonceBytes, server_nonce.begin());
  const AuthProof server_proof = HandshakeProof(auth_secret, AuthContext::kFdSocket,
                                                AuthRole::kServer, *client_nonce, server_nonce);
  if (!ProofMatches(std::span(challenge).subspan(kAuthNonceBytes), server_proof)) {
    return PermissionDeniedError("fd server '" + name +
                                 "' failed to prove the shared secret (the auth secrets differ)");
  }
  const AuthProof client_proof = HandshakeProof(auth_secret, AuthContext::kFdSocket,
                                                AuthRole::kClient, *client_nonce, server_nonce);
  if (!WriteAll(c, client_proof.data(), client_proof.size(), deadline)) {
    return UnavailableError("fd request to '" + name + "' failed to send its proof");
  }
  uint8_t status = 1;
  iovec iov{&status, 1};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t got =
      WaitReady(c, POLLIN, deadline) ? ::recvmsg(c, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT) : -1;
  if (got != 1) return UnavailableError("fd server '" + name + "' did not answer");
  cmsghdr* cm = CMSG_FIRSTHDR(&msg);
  int fd = -1;
  if (cm != nullptr && cm->cmsg_type == SCM_RIGHTS) std::memcpy(&fd, CMSG_DATA(cm), sizeof(int));
  if (status != 0) {
    if (fd >= 0) ::close(fd);
    return NotFoundError("fd server '" + name + "' refused region key");
  }
  if (fd < 0) return UnavailableError("fd server '" + name + "' sent no descriptor");
  return fd;
}

}  // namespace kvferry
