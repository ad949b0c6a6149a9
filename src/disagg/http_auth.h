// Bearer-token authentication of kvferry's HTTP servers (the bootstrap server and the
// instances' control servers) and their clients (docs/security.md).
//
// With a shared secret every route but GET /health requires "Authorization: Bearer <token>",
// the token derived from the secret (HttpBearerToken: the engine secret cannot be computed from
// it); anything else is answered 401 before its handler runs or its body is read, and the
// connection is closed. Refusals are logged at most once a second per server.
//
// Thread-safety: the handler installed may run on any of the server's threads.
#pragma once

#include <httplib.h>

#include <memory>
#include <string>

#include "common/auth.h"
#include "common/log_limiter.h"
#include "common/logging.h"

namespace kvferry {

// Installs the check on `server` (before its routes run) when `secret` is non-empty; `what`
// names the server in log lines.
inline void RequireBearerToken(httplib::Server& server, const std::string& secret,
                               const std::string& what) {
  if (secret.empty()) return;
  auto limiter = std::make_shared<LogLimiter>();
  server.set_pre_routing_handler([token = HttpBearerToken(secret), limiter, what](
                                     const httplib::Request& req, httplib::Response& res) {
    if (req.path == "/health" || BearerMatches(req.get_header_value("Authorization"), token)) {
      return httplib::Server::HandlerResponse::Unhandled;
    }
    if (uint64_t dropped = 0; limiter->Allow(&dropped)) {
      KVF_LOG_WARN(
          "{}: refused {} {} from {}: missing or wrong bearer token{}", what, req.method, req.path,
          req.remote_addr,
          dropped > 0 ? " (" + std::to_string(dropped) + " more refusals not logged)" : "");
    }
    res.status = 401;
    res.set_header("WWW-Authenticate", "Bearer");
    res.set_header("Connection", "close");
    res.set_content(
        "401: this route needs 'Authorization: Bearer <token>', the token derived from the "
        "deployment's shared secret (KVFERRY_AUTH_TOKEN or --auth-token-file)\n",
        "text/plain");
    return httplib::Server::HandlerResponse::Handled;
  });
}

// Makes `client` send the bearer token of `secret` with every request (nothing when empty).
template <typename Client>
void SetBearerToken(Client& client, const std::string& secret) {
  if (!secret.empty()) client.set_bearer_token_auth(HttpBearerToken(secret));
}

}  // namespace kvferry
