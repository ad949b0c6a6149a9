// Bootstrap service: how decode ranks find the prefill ranks they pair with.
//
// In prefill/decode (PD) disaggregation the prefill instance runs a small HTTP bootstrap
// server. Every prefill rank registers itself there (its attention TP/CP/PP rank, the
// "host:port" of its transfer engine and its segment name, plus the instance-wide geometry:
// parallel sizes, page size, KV dtype). A decode rank asks the server for the prefill
// topology, checks that it can pair with it (CheckPairing) and looks up the address of the
// prefill rank that holds the KV heads it needs.
//
// Wire protocol (JSON bodies; error bodies are plain text naming the problem):
//   PUT /route    one PrefillRegistration, flat: {"tp_rank", "cp_rank", "pp_rank",
//                 "engine_address", "name", "tp_size", "cp_size", "pp_size", "page_size",
//                 "kv_dtype", "model", "num_kv_heads"}; "name", "model" and "num_kv_heads"
//                 are optional (default "", "", 0).
//                 200 on success; 400 on malformed JSON, missing or mistyped fields, a rank
//                 outside [0, size) or page_size <= 0; 409 when the sizes, page_size,
//                 kv_dtype or num_kv_heads differ from the ranks registered before (the
//                 message states both values). Re-registering a rank replaces it (a
//                 restarted rank).
//   GET /route    the PrefillTopology: the geometry fields above, "complete" (bool) and
//                 "ranks" (array of {"tp_rank", "cp_rank", "pp_rank", "engine_address",
//                 "name"}, sorted by (pp, cp, tp)).
//   GET /route?tp_rank=X&cp_rank=Y&pp_rank=Z
//                 that one rank, or 404 when it has not registered.
//   GET /health   200 "OK".
//
// Authentication (docs/security.md): with a shared secret (BootstrapServerOptions::auth_secret,
// else KVFERRY_AUTH_TOKEN) every route but GET /health needs "Authorization: Bearer <token>",
// the token derived from the secret; without it the answer is 401 and nothing is registered or
// listed.
//
// Thread-safety: BootstrapServer serves concurrent requests from its own threads; its
// methods may be called from any thread. BootstrapClient holds no connection between calls
// (each call opens its own), so one client may be used from several threads at once. The
// plain structs are values.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/status.h"

namespace kvferry {

// One prefill rank as decode sees it.
struct PrefillRankInfo {
  int tp_rank = 0;             // attention tensor-parallel rank, in [0, tp_size)
  int cp_rank = 0;             // context-parallel rank, in [0, cp_size)
  int pp_rank = 0;             // pipeline-parallel rank, in [0, pp_size)
  std::string engine_address;  // transfer engine "host:port" of that rank
  std::string name;            // engine (segment) name
};

// What one prefill rank PUTs to the bootstrap server. The geometry fields are the same on
// every rank of one prefill instance; the server refuses a rank whose geometry differs.
struct PrefillRegistration {
  PrefillRankInfo rank;
  int tp_size = 1;       // attention TP size, >= 1
  int cp_size = 1;       // CP size, >= 1
  int pp_size = 1;       // PP size, >= 1
  int page_size = 0;     // tokens per KV page, > 0
  std::string kv_dtype;  // e.g. "bfloat16", non-empty
  std::string model;     // model/geometry name, informational (not checked)
  int num_kv_heads = 0;  // total KV heads of the model (0 for MLA)
};

// The prefill instance as registered so far.
struct PrefillTopology {
  int tp_size = 1, cp_size = 1, pp_size = 1;
  int page_size = 0;  // tokens per page; 0 while no rank has registered
  std::string kv_dtype;
  std::string model;
  int num_kv_heads = 0;
  std::vector<PrefillRankInfo> ranks;  // registered so far, sorted by (pp, cp, tp)

  // True when every (tp, cp, pp) rank in [0, tp_size) x [0, cp_size) x [0, pp_size) is
  // registered exactly once. False while no rank has registered.
  bool complete() const;
};

struct BootstrapServerOptions {
  // Address to listen on. Default loopback; use "0.0.0.0" to serve other hosts.
  std::string host = "127.0.0.1";
  // TCP port; 0 (default) lets the kernel pick a free one (see BootstrapServer::port()).
  uint16_t port = 0;
  // Request-handling threads, >= 1. A connection holds one while it sends its request (at
  // most read_timeout between bytes); 32 (default) keeps serving while a few clients
  // trickle theirs.
  int num_threads = 32;
  // Longest wait for a client's next bytes, or for it to take an answer's. Default 2 s.
  std::chrono::milliseconds io_timeout{2000};
  // The deployment's shared secret (at least 16 bytes): every route but /health then needs its
  // bearer token. Empty (default): KVFERRY_AUTH_TOKEN when set, else none.
  std::string auth_secret;
  // Listening on a non-loopback host without a secret is refused unless this is set.
  bool insecure = false;
};

// The prefill side's bootstrap HTTP server.
class BootstrapServer {
 public:
  // Binds, starts serving on background threads and returns once the socket is listening
  // (requests may be sent as soon as this returns).
  // Errors: kInvalidArgument for an empty host, num_threads < 1 or a malformed secret;
  // kFailedPrecondition for a non-loopback host without a secret or `insecure`; kUnavailable
  // when the address cannot be bound (port in use, host not local), naming host:port.
  static StatusOr<std::unique_ptr<BootstrapServer>> Create(const BootstrapServerOptions& options);

  // Stops listening and joins the serving threads; blocks until in-flight requests finish.
  ~BootstrapServer();

  BootstrapServer(const BootstrapServer&) = delete;
  BootstrapServer& operator=(const BootstrapServer&) = delete;

  // "host:port" clients should use, with the bound port (never 0).
  std::string address() const;
  // The bound TCP port (the kernel's pick when options.port was 0).
  uint16_t port() const;

 private:
  class Impl;
  explicit BootstrapServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Talks to a BootstrapServer. Every call blocks for at most about `timeout` (connect plus
// read), except WaitForTopology which takes its own deadline.
//
// Error codes of every call: kUnavailable when the server cannot be reached or the
// connection drops (the message names the address); kInvalidArgument for an address that
// is not "host:port", a 400 answer or a malformed secret; kPermissionDenied for 401 (no or a
// different secret); kNotFound for 404; kFailedPrecondition for 409;
// kInternal for a 5xx answer or a response that is not the expected JSON. Messages carry
// the server's own explanation.
class BootstrapClient {
 public:
  // `address` is the server's "host:port" (e.g. BootstrapServer::address()). `timeout`
  // bounds connecting and each read/write of one request. `auth_secret`: the deployment's
  // shared secret, whose bearer token every request but Health carries; empty (default):
  // KVFERRY_AUTH_TOKEN when set, else none.
  explicit BootstrapClient(std::string address,
                           std::chrono::milliseconds timeout = std::chrono::milliseconds(5000),
                           std::string auth_secret = "");

  // PUTs this rank's registration. kFailedPrecondition when it conflicts with ranks
  // registered earlier (different sizes, page_size, kv_dtype or num_kv_heads).
  Status RegisterRank(const PrefillRegistration& registration);

  // Returns the topology registered so far (possibly incomplete, possibly with no ranks).
  StatusOr<PrefillTopology> GetTopology();

  // Returns one registered rank; kNotFound if that rank has not registered.
  StatusOr<PrefillRankInfo> GetRank(int tp_rank, int cp_rank, int pp_rank);

  // OK when the server answers GET /health with 200.
  Status Health();

  // Polls GetTopology until complete() or `timeout` passes. While the server is not
  // reachable yet (kUnavailable) it keeps polling; other errors return at once.
  // kDeadlineExceeded on timeout, naming how many ranks registered of how many expected
  // (or the last connection error when the server never answered). `cancelled` (not owned;
  // null: never) is read before each poll: once true, the wait ends with kCancelled (its
  // owner is closing). Polls are at most 200 ms apart, and with `cancelled` each request
  // takes at most 1 s, so a cancellation is seen within about 1.2 s.
  StatusOr<PrefillTopology> WaitForTopology(std::chrono::milliseconds timeout,
                                            const std::atomic<bool>* cancelled = nullptr);

 private:
  std::string address_;
  std::chrono::milliseconds timeout_;
  std::string auth_secret_;
};

// Decode refuses to pair with a prefill instance whose page size or KV dtype differ from its
// own: pages are copied whole, so a mismatch would scatter tokens or reinterpret bytes.
// Returns kFailedPrecondition stating both values, e.g.
// "page_size mismatch: prefill 64, decode 16" or
// "kv_dtype mismatch: prefill bfloat16, decode float8_e4m3fn".
Status CheckPairing(const PrefillTopology& prefill, int decode_page_size,
                    std::string_view decode_kv_dtype);

}  // namespace kvferry
