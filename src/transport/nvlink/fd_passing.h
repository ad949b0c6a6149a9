// File-descriptor passing between processes of one node (SCM_RIGHTS over an abstract Unix
// socket), used to share cuMem allocations exported as POSIX file descriptors.
//
// Protocol: the client connects, sends the region key (u64, little-endian); the server
// answers one status byte (0 = OK) with the descriptor attached, or a non-zero byte followed
// by nothing. One request per connection.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>

#include "kvferry/status.h"

namespace kvferry {

class FdServer {
 public:
  // `provider` returns a new descriptor for a key (the server closes it after sending).
  using Provider = std::function<StatusOr<int>(uint64_t key)>;
  // Listens on the abstract socket "\0<name>". Errors: kUnavailable.
  static StatusOr<std::unique_ptr<FdServer>> Create(const std::string& name, Provider provider);
  ~FdServer();
  const std::string& name() const { return name_; }

 private:
  FdServer() = default;
  void Loop();
  std::string name_;
  Provider provider_;
  int listen_fd_ = -1;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

// Asks the server `name` for the descriptor of `key`. Errors: kUnavailable (no server),
// kNotFound (the server refused the key).
StatusOr<int> RequestFd(const std::string& name, uint64_t key);

}  // namespace kvferry
