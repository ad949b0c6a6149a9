// BootstrapClient: one short-lived cpp-httplib client per call, HTTP answers mapped to Status.
#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "common/auth.h"
#include "common/checks.h"
#include "common/host_port.h"
#include "disagg/bootstrap_wire.h"
#include "disagg/http_auth.h"
#include "kvferry/bootstrap.h"

namespace kvferry {
namespace {

using Clock = std::chrono::steady_clock;

struct HttpAnswer {
  int status = 0;
  std::string body;
};

// Maps a non-2xx answer to the Status the caller should act on; the server's text is kept.
Status StatusFromHttp(const std::string& what, const HttpAnswer& answer) {
  std::string message = what + ": ";
  std::string body = answer.body;
  while (!body.empty() && (body.back() == '\n' || body.back() == '\r')) body.pop_back();
  message += body.empty() ? "HTTP " + std::to_string(answer.status) : body;
  switch (answer.status) {
    case 400:
      return InvalidArgumentError(std::move(message));
    case 401:
      return PermissionDeniedError(std::move(message));
    case 404:
      return NotFoundError(std::move(message));
    case 409:
      return FailedPreconditionError(std::move(message));
    case 503:
      return UnavailableError(std::move(message));
    default:
      if (answer.status >= 500) return InternalError(std::move(message));
      return {StatusCode::kUnknown,
              "unexpected HTTP " + std::to_string(answer.status) + " " + std::move(message)};
  }
}

// One request. `what` ("PUT /route at host:port") prefixes every error message.
// `secret` (empty: none) gives the bearer token sent.
StatusOr<HttpAnswer> Send(const std::string& address, const std::string& secret,
                          std::chrono::milliseconds timeout, const std::string& method,
                          const std::string& path, const std::string* json_body,
                          const std::string& what) {
  ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(address, "bootstrap address"));
  try {
    httplib::Client client(hp.host, hp.port);
    SetBearerToken(client, secret);
    client.set_connection_timeout(timeout);
    client.set_read_timeout(timeout);
    client.set_write_timeout(timeout);
    client.set_keep_alive(false);
    httplib::Result result = method == "PUT"
                                 ? client.Put(path.c_str(), *json_body, "application/json")
                                 : client.Get(path.c_str());
    if (!result) {
      return UnavailableError(what + ": bootstrap server unreachable (" +
                              httplib::to_string(result.error()) + ")");
    }
    return HttpAnswer{result->status, result->body};
  } catch (const std::exception& e) {
    return InternalError(what + ": " + e.what());
  }
}

StatusOr<nlohmann::json> ParseAnswer(const std::string& what, const HttpAnswer& answer) {
  StatusOr<nlohmann::json> value = bootstrap_wire::ParseJson(answer.body);
  if (!value.ok())
    return InternalError(what + ": unexpected response: " + value.status().message());
  return value;
}

// GET /route with an explicit per-request timeout (WaitForTopology shortens it to its deadline).
StatusOr<PrefillTopology> FetchTopology(const std::string& address, const std::string& secret,
                                        std::chrono::milliseconds timeout) {
  const std::string what = "GET /route at " + address;
  ASSIGN_OR_RETURN(HttpAnswer answer,
                   Send(address, secret, timeout, "GET", "/route", nullptr, what));
  if (answer.status != 200) return StatusFromHttp(what, answer);
  ASSIGN_OR_RETURN(nlohmann::json value, ParseAnswer(what, answer));
  StatusOr<PrefillTopology> topology = bootstrap_wire::TopologyFromJson(value);
  if (!topology.ok()) {
    return InternalError(what + ": unexpected response: " + topology.status().message());
  }
  return topology;
}

}  // namespace

BootstrapClient::BootstrapClient(std::string address, std::chrono::milliseconds timeout,
                                 std::string auth_secret)
    : address_(std::move(address)), timeout_(timeout), auth_secret_(std::move(auth_secret)) {}

Status BootstrapClient::RegisterRank(const PrefillRegistration& registration) {
  const std::string what = "PUT /route at " + address_;
  const std::string body = bootstrap_wire::RegistrationToJson(registration).dump();
  ASSIGN_OR_RETURN(std::string secret, ResolveAuthSecret(auth_secret_));
  ASSIGN_OR_RETURN(HttpAnswer answer,
                   Send(address_, secret, timeout_, "PUT", "/route", &body, what));
  if (answer.status != 200) return StatusFromHttp(what, answer);
  return OkStatus();
}

StatusOr<PrefillTopology> BootstrapClient::GetTopology() {
  ASSIGN_OR_RETURN(std::string secret, ResolveAuthSecret(auth_secret_));
  return FetchTopology(address_, secret, timeout_);
}

StatusOr<PrefillRankInfo> BootstrapClient::GetRank(int tp_rank, int cp_rank, int pp_rank) {
  if (tp_rank < 0 || cp_rank < 0 || pp_rank < 0) {
    return InvalidArgumentError("negative rank (tp " + std::to_string(tp_rank) + ", cp " +
                                std::to_string(cp_rank) + ", pp " + std::to_string(pp_rank) + ")");
  }
  const std::string path = "/route?tp_rank=" + std::to_string(tp_rank) +
                           "&cp_rank=" + std::to_string(cp_rank) +
                           "&pp_rank=" + std::to_string(pp_rank);
  const std::string what = "GET " + path + " at " + address_;
  ASSIGN_OR_RETURN(std::string secret, ResolveAuthSecret(auth_secret_));
  ASSIGN_OR_RETURN(HttpAnswer answer, Send(address_, secret, timeout_, "GET", path, nullptr, what));
  if (answer.status != 200) return StatusFromHttp(what, answer);
  ASSIGN_OR_RETURN(nlohmann::json value, ParseAnswer(what, answer));
  StatusOr<PrefillRankInfo> rank = bootstrap_wire::RankFromJson(value);
  if (!rank.ok()) return InternalError(what + ": unexpected response: " + rank.status().message());
  return rank;
}

Status BootstrapClient::Health() {
  const std::string what = "GET /health at " + address_;
  ASSIGN_OR_RETURN(HttpAnswer answer,
                   Send(address_, "", timeout_, "GET", "/health", nullptr, what));
  if (answer.status != 200) return StatusFromHttp(what, answer);
  return OkStatus();
}

// The longest one topology request of a cancellable WaitForTopology may take.
constexpr std::chrono::milliseconds kCancellablePoll{1000};

StatusOr<PrefillTopology> BootstrapClient::WaitForTopology(std::chrono::milliseconds timeout,
                                                           const std::atomic<bool>* cancelled) {
  const Clock::time_point deadline = Clock::now() + timeout;
  ASSIGN_OR_RETURN(std::string secret, ResolveAuthSecret(auth_secret_));
  // Start fast (ranks usually register within milliseconds of each other), back off to 200 ms
  // so a long wait does not hammer the server.
  std::chrono::milliseconds poll(10);
  std::optional<PrefillTopology> last;
  Status last_error;
  while (true) {
    if (cancelled != nullptr && cancelled->load()) {
      return CancelledError("stopped waiting for the prefill topology at " + address_ +
                            ": closing");
    }
    // Never let one request run past the caller's deadline (1 ms floor keeps it a real try);
    // a cancellable wait asks at most kCancellablePoll at a time, so that a server that does
    // not answer does not hold the cancellation (a timed-out request counts as unavailable).
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    std::chrono::milliseconds request_timeout =
        std::max(std::chrono::milliseconds(1), std::min(left, timeout_));
    if (cancelled != nullptr) request_timeout = std::min(request_timeout, kCancellablePoll);
    StatusOr<PrefillTopology> topology = FetchTopology(address_, secret, request_timeout);
    if (topology.ok()) {
      if (topology->complete()) return topology;
      last = std::move(topology).value();
    } else if (topology.status().code() == StatusCode::kUnavailable) {
      last_error = topology.status();  // server not up yet: keep polling
    } else {
      return topology.status();
    }
    const Clock::time_point now = Clock::now();
    if (now >= deadline) break;
    std::this_thread::sleep_for(std::min<Clock::duration>(poll, deadline - now));
    poll = std::min(poll * 2, std::chrono::milliseconds(200));
  }
  const std::string waited = std::to_string(timeout.count()) + " ms";
  if (last.has_value()) {
    const long expected = static_cast<long>(last->tp_size) * last->cp_size * last->pp_size;
    std::string message = "prefill topology at " + address_ + " incomplete after " + waited + ": " +
                          std::to_string(last->ranks.size()) + " of " +
                          (last->ranks.empty() ? std::string("?") : std::to_string(expected)) +
                          " ranks registered";
    return DeadlineExceededError(std::move(message));
  }
  return DeadlineExceededError("no prefill topology after " + waited + ": " + last_error.message());
}

Status CheckPairing(const PrefillTopology& prefill, int decode_page_size,
                    std::string_view decode_kv_dtype) {
  if (prefill.page_size != decode_page_size) {
    return FailedPreconditionError("page_size mismatch: prefill " +
                                   std::to_string(prefill.page_size) + ", decode " +
                                   std::to_string(decode_page_size));
  }
  if (prefill.kv_dtype != decode_kv_dtype) {
    return FailedPreconditionError("kv_dtype mismatch: prefill " + prefill.kv_dtype + ", decode " +
                                   std::string(decode_kv_dtype));
  }
  return OkStatus();
}

}  // namespace kvferry
