// BootstrapServer: cpp-httplib server holding the prefill ranks' registrations.
//
// The registry is a map keyed by (pp, cp, tp) under one mutex; handlers run on httplib's
// thread pool. No exception leaves a handler: JSON errors come back as Status from
// bootstrap_wire, and anything unexpected is caught and answered with 500.
#include <httplib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>

#include "common/auth.h"
#include "common/checks.h"
#include "common/listen_socket.h"
#include "common/logging.h"
#include "disagg/bootstrap_wire.h"
#include "disagg/http_auth.h"
#include "kvferry/bootstrap.h"

namespace kvferry {
namespace {

constexpr char kTextPlain[] = "text/plain";
constexpr char kJson[] = "application/json";
// Registrations are a few hundred bytes; refuse anything absurd before parsing it.
constexpr size_t kMaxBodyBytes = 64 * 1024;

// Key ordering gives the documented (pp, cp, tp) order of PrefillTopology::ranks.
using RankKey = std::tuple<int, int, int>;  // pp, cp, tp

RankKey KeyOf(const PrefillRankInfo& rank) { return {rank.pp_rank, rank.cp_rank, rank.tp_rank}; }

std::string RankName(const PrefillRankInfo& r) {
  return "tp_rank " + std::to_string(r.tp_rank) + ", cp_rank " + std::to_string(r.cp_rank) +
         ", pp_rank " + std::to_string(r.pp_rank);
}

// Parses a non-negative decimal query parameter; nullopt when it is not one.
std::optional<int> ParseRankParam(const std::string& text) {
  if (text.empty() || text.size() > 9) return std::nullopt;
  int value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    value = value * 10 + (c - '0');
  }
  return value;
}

}  // namespace

class BootstrapServer::Impl {
 public:
  // `secret`: the resolved shared secret (empty: none).
  Impl(const BootstrapServerOptions& options, std::string secret)
      : options_(options), secret_(std::move(secret)) {}

  ~Impl() {
    if (thread_.joinable()) {
      server_.stop();
      thread_.join();
    }
  }

  Status Start() {
    const int num_threads = options_.num_threads;
    server_.new_task_queue = [num_threads] {
      return new httplib::ThreadPool(static_cast<size_t>(num_threads));
    };
    server_.set_payload_max_length(kMaxBodyBytes);
    // SO_REUSEADDR without httplib's SO_REUSEPORT (a second bootstrap server on the same
    // port would silently receive half of the registrations); the socket offered last is the
    // one bound, its backlog raised after the bind (common/listen_socket.h).
    server_.set_socket_options([this](socket_t sock) {
      SetListenAddressReuse(sock);
      listen_fd_ = sock;
    });
    // Bounds how long the destructor can wait on an idle keep-alive connection.
    server_.set_keep_alive_timeout(1);
    // A client that stops sending (or reading) frees its thread after io_timeout.
    const auto io = options_.io_timeout;
    server_.set_read_timeout(io.count() / 1000, (io.count() % 1000) * 1000);
    server_.set_write_timeout(io.count() / 1000, (io.count() % 1000) * 1000);
    server_.set_exception_handler(
        [](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
          res.status = 500;
          res.set_content("internal error in bootstrap server", kTextPlain);
        });
    RequireBearerToken(server_, secret_, "bootstrap server");
    server_.Put("/route", [this](const httplib::Request& req, httplib::Response& res) {
      Guarded(res, [&] { HandlePut(req, res); });
    });
    server_.Get("/route", [this](const httplib::Request& req, httplib::Response& res) {
      Guarded(res, [&] { HandleGet(req, res); });
    });
    server_.Get("/health", [](const httplib::Request&, httplib::Response& res) {
      res.set_content("OK", kTextPlain);
    });

    const std::string where = options_.host + ":" + std::to_string(options_.port);
    int bound_port = -1;
    if (options_.port == 0) {
      bound_port = server_.bind_to_any_port(options_.host);
    } else if (server_.bind_to_port(options_.host, options_.port)) {
      bound_port = options_.port;
    }
    if (bound_port <= 0) {
      return UnavailableError("bootstrap server cannot bind " + where);
    }
    // httplib listens with a backlog of 5: a burst of registrations would be reset.
    if (Status s = RaiseListenBacklog(listen_fd_); !s.ok()) {
      // The accept loop never ran, so httplib would not close the bound socket.
      if (listen_fd_ >= 0) ::close(listen_fd_);
      return s.WithContext("bootstrap server on " + where);
    }
    port_ = static_cast<uint16_t>(bound_port);

    // The socket is already listening (clients queue in the backlog), but stop() is a no-op
    // until the accept loop has marked itself running, so wait for that before returning:
    // otherwise a destructor right after Create() could miss the loop and hang in join().
    thread_ = std::thread([this] {
      if (!server_.listen_after_bind()) {
        KVF_LOG_WARN("bootstrap server on {} stopped with an error", address());
      }
      loop_exited_.store(true);
    });
    while (!server_.is_running() && !loop_exited_.load()) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (!server_.is_running()) {
      thread_.join();
      return UnavailableError("bootstrap server on " + address() + " failed to start");
    }
    KVF_LOG_INFO("bootstrap server listening on {}", address());
    return OkStatus();
  }

  std::string address() const {
    // Bracket IPv6 literals so the port stays unambiguous.
    const bool ipv6 = options_.host.find(':') != std::string::npos;
    return (ipv6 ? "[" + options_.host + "]" : options_.host) + ":" + std::to_string(port_);
  }
  uint16_t port() const { return port_; }

 private:
  template <typename F>
  static void Guarded(httplib::Response& res, F&& body) {
    try {
      body();
    } catch (const std::exception& e) {
      res.status = 500;
      res.set_content(std::string("internal error in bootstrap server: ") + e.what(), kTextPlain);
    } catch (...) {
      res.status = 500;
      res.set_content("internal error in bootstrap server", kTextPlain);
    }
  }

  static void Fail(httplib::Response& res, int http_status, const std::string& message) {
    res.status = http_status;
    res.set_content(message, kTextPlain);
  }

  // Returns the first field in which `reg` differs from `other`, stating both values, or "".
  static std::string Conflict(const PrefillRegistration& registered,
                              const PrefillRegistration& reg) {
    auto num = [](const char* field, int a, int b) {
      return std::string(field) + " conflict: registered " + std::to_string(a) + ", this rank " +
             std::to_string(b);
    };
    if (reg.tp_size != registered.tp_size) return num("tp_size", registered.tp_size, reg.tp_size);
    if (reg.cp_size != registered.cp_size) return num("cp_size", registered.cp_size, reg.cp_size);
    if (reg.pp_size != registered.pp_size) return num("pp_size", registered.pp_size, reg.pp_size);
    if (reg.page_size != registered.page_size) {
      return num("page_size", registered.page_size, reg.page_size);
    }
    if (reg.num_kv_heads != registered.num_kv_heads) {
      return num("num_kv_heads", registered.num_kv_heads, reg.num_kv_heads);
    }
    if (reg.kv_dtype != registered.kv_dtype) {
      return "kv_dtype conflict: registered " + registered.kv_dtype + ", this rank " + reg.kv_dtype;
    }
    return "";
  }

  void HandlePut(const httplib::Request& req, httplib::Response& res) {
    StatusOr<nlohmann::json> body = bootstrap_wire::ParseJson(req.body);
    if (!body.ok()) return Fail(res, 400, body.status().message());
    StatusOr<PrefillRegistration> reg = bootstrap_wire::RegistrationFromJson(*body);
    if (!reg.ok()) return Fail(res, 400, reg.status().message());

    std::lock_guard<std::mutex> lock(mutex_);
    const RankKey key = KeyOf(reg->rank);
    // Compare with every other rank: a lone rank that restarts with a new geometry simply
    // replaces itself, but it cannot disagree with ranks that are still registered.
    for (const auto& [other_key, other] : registry_) {
      if (other_key == key) continue;
      std::string conflict = Conflict(other, *reg);
      if (!conflict.empty()) {
        return Fail(res, 409, RankName(reg->rank) + ": " + conflict);
      }
    }
    const bool replaced = registry_.count(key) > 0;
    KVF_LOG_INFO("bootstrap: {} {} at {}", replaced ? "re-registered" : "registered",
                 RankName(reg->rank), reg->rank.engine_address);
    registry_[key] = std::move(reg).value();
    res.set_content(replaced ? "replaced" : "registered", kTextPlain);
  }

  void HandleGet(const httplib::Request& req, httplib::Response& res) {
    const bool any =
        req.has_param("tp_rank") || req.has_param("cp_rank") || req.has_param("pp_rank");
    if (!any) {
      res.set_content(bootstrap_wire::TopologyToJson(Snapshot()).dump(), kJson);
      return;
    }
    int ranks[3] = {0, 0, 0};
    const char* names[3] = {"tp_rank", "cp_rank", "pp_rank"};
    for (int i = 0; i < 3; ++i) {
      if (!req.has_param(names[i])) {
        return Fail(res, 400,
                    std::string("missing query parameter '") + names[i] +
                        "' (need tp_rank, cp_rank and pp_rank)");
      }
      std::optional<int> v = ParseRankParam(req.get_param_value(names[i]));
      if (!v) {
        return Fail(res, 400,
                    std::string("query parameter '") + names[i] +
                        "' must be a non-negative integer, got '" + req.get_param_value(names[i]) +
                        "'");
      }
      ranks[i] = *v;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = registry_.find(RankKey{ranks[2], ranks[1], ranks[0]});
    if (it == registry_.end()) {
      PrefillRankInfo wanted;
      wanted.tp_rank = ranks[0];
      wanted.cp_rank = ranks[1];
      wanted.pp_rank = ranks[2];
      return Fail(res, 404, RankName(wanted) + " has not registered");
    }
    res.set_content(bootstrap_wire::RankToJson(it->second.rank).dump(), kJson);
  }

  PrefillTopology Snapshot() {
    std::lock_guard<std::mutex> lock(mutex_);
    PrefillTopology topology;
    if (registry_.empty()) return topology;
    // All entries agree on the geometry (checked at registration); take it from the first.
    const PrefillRegistration& first = registry_.begin()->second;
    topology.tp_size = first.tp_size;
    topology.cp_size = first.cp_size;
    topology.pp_size = first.pp_size;
    topology.page_size = first.page_size;
    topology.kv_dtype = first.kv_dtype;
    topology.model = first.model;
    topology.num_kv_heads = first.num_kv_heads;
    topology.ranks.reserve(registry_.size());
    for (const auto& entry : registry_) topology.ranks.push_back(entry.second.rank);
    return topology;
  }

  const BootstrapServerOptions options_;
  const std::string secret_;
  httplib::Server server_;
  std::thread thread_;
  std::atomic<bool> loop_exited_{false};
  uint16_t port_ = 0;
  int listen_fd_ = -1;  // the socket httplib bound (from its socket-options callback)

  std::mutex mutex_;
  std::map<RankKey, PrefillRegistration> registry_;  // guarded by mutex_
};

StatusOr<std::unique_ptr<BootstrapServer>> BootstrapServer::Create(
    const BootstrapServerOptions& options) {
  if (options.host.empty()) return InvalidArgumentError("bootstrap server host is empty");
  if (options.io_timeout.count() <= 0) {
    return InvalidArgumentError("bootstrap server io_timeout must be positive");
  }
  if (options.num_threads < 1) {
    return InvalidArgumentError("bootstrap server num_threads must be >= 1, got " +
                                std::to_string(options.num_threads));
  }
  ASSIGN_OR_RETURN(std::string secret, ResolveAuthSecret(options.auth_secret));
  RETURN_IF_ERROR(
      CheckListenSecurity("bootstrap server", options.host, !secret.empty(), options.insecure));
  auto impl = std::make_unique<Impl>(options, std::move(secret));
  RETURN_IF_ERROR(impl->Start());
  return std::unique_ptr<BootstrapServer>(new BootstrapServer(std::move(impl)));
}

BootstrapServer::BootstrapServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

BootstrapServer::~BootstrapServer() = default;

std::string BootstrapServer::address() const { return impl_->address(); }

uint16_t BootstrapServer::port() const { return impl_->port(); }

}  // namespace kvferry
