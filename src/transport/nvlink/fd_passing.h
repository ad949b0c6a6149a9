// File-descriptor passing between processes of one node (SCM_RIGHTS over an abstract Unix
// socket), used to share cuMem allocations exported as POSIX file descriptors.
//
// Protocol, one request per connection, authenticated by challenge and response (common/auth.h,
// context kFdSocket) before the server says anything about a key:
//   client -> server  its nonce (32 bytes), the region key (u64, little-endian)
//   server -> client  its nonce (32 bytes), its proof (32 bytes)
//   client -> server  its proof (32 bytes), sent only once the server's proof holds
//   server -> client  one status byte (0 = OK) with the descriptor attached, or a non-zero
//                     byte followed by nothing; a wrong proof closes the connection unanswered.
// Both sides prove the same secret (the engine's); without one both prove "no secret".
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "common/log_limiter.h"
#include "kvferry/status.h"

namespace kvferry {

class FdServer {
 public:
  // `provider` returns a new descriptor for a key (the server closes it after sending).
  using Provider = std::function<StatusOr<int>(uint64_t key)>;
  // Listens on the abstract socket "\0<name>"; clients must prove `auth_secret` (empty: none).
  // Errors: kUnavailable.
  static StatusOr<std::unique_ptr<FdServer>> Create(const std::string& name,
                                                    const std::string& auth_secret,
                                                    Provider provider);
  ~FdServer();
  const std::string& name() const { return name_; }

 private:
  FdServer() = default;
  void Loop();
  // Runs one request on the accepted connection `c`, all of it before `deadline`; returns
  // why it was refused, or "".
  std::string Serve(int c, std::chrono::steady_clock::time_point deadline);
  std::string name_;
  std::string auth_secret_;
  Provider provider_;
  int listen_fd_ = -1;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
  LogLimiter refused_log_;
};

// Asks the server `name` for the descriptor of `key`, proving `auth_secret` (empty: none).
// Blocks up to 5 s in all (connecting included). The server serves one connection at a time and
// gives each 2 s for the whole exchange.
// Errors: kUnavailable (no server, no answer in time), kPermissionDenied (the server did not
// prove the secret), kNotFound (the server refused the key).
StatusOr<int> RequestFd(const std::string& name, uint64_t key, const std::string& auth_secret);

}  // namespace kvferry
