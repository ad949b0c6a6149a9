#include "transport/nvlink/fd_passing.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <memory>

namespace kvferry {
namespace {

socklen_t AbstractAddress(const std::string& name, sockaddr_un* addr) {
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  size_t n = std::min(name.size(), sizeof(addr->sun_path) - 2);
  std::memcpy(addr->sun_path + 1, name.data(), n);  // sun_path[0] = 0: abstract namespace
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

bool ReadAll(int fd, void* buf, size_t n) {
  auto* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    ssize_t r = ::read(fd, p, n);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

}  // namespace

StatusOr<std::unique_ptr<FdServer>> FdServer::Create(const std::string& name, Provider provider) {
  std::unique_ptr<FdServer> s(new FdServer());
  s->name_ = name;
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
    timeval tv{2, 0};
    ::setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    uint8_t key_bytes[8];
    if (ReadAll(c, key_bytes, 8)) {
      uint64_t key = 0;
      for (int i = 0; i < 8; ++i) key |= static_cast<uint64_t>(key_bytes[i]) << (8 * i);
      StatusOr<int> fd = provider_(key);
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
      (void)!::sendmsg(c, &msg, MSG_NOSIGNAL);
      if (fd.ok()) ::close(*fd);
    }
    ::close(c);
  }
}

StatusOr<int> RequestFd(const std::string& name, uint64_t key) {
  int c = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (c < 0) return UnavailableError("socket: " + std::string(strerror(errno)));
  std::unique_ptr<int, void (*)(int*)> guard(&c, [](int* f) { ::close(*f); });
  sockaddr_un addr;
  socklen_t len = AbstractAddress(name, &addr);
  if (::connect(c, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    return UnavailableError("cannot reach fd server '" + name + "': " + strerror(errno));
  }
  uint8_t key_bytes[8];
  for (int i = 0; i < 8; ++i) key_bytes[i] = static_cast<uint8_t>(key >> (8 * i));
  if (::write(c, key_bytes, 8) != 8) return UnavailableError("fd request send failed");
  uint8_t status = 1;
  iovec iov{&status, 1};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  timeval tv{5, 0};
  ::setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  if (::recvmsg(c, &msg, 0) != 1)
    return UnavailableError("fd server '" + name + "' did not answer");
  if (status != 0) return NotFoundError("fd server '" + name + "' refused region key");
  cmsghdr* cm = CMSG_FIRSTHDR(&msg);
  if (cm == nullptr || cm->cmsg_type != SCM_RIGHTS) {
    return UnavailableError("fd server '" + name + "' sent no descriptor");
  }
  int fd = -1;
  std::memcpy(&fd, CMSG_DATA(cm), sizeof(int));
  return fd;
}

}  // namespace kvferry
