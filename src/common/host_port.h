// Network endpoint names: the one parser of "host:port" text used by every part of kvferry
// (engine addresses, bootstrap and control addresses, command-line flags), and the name of
// this machine that engines on one node share.
//
// Thread-safety: plain functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kvferry/status.h"

namespace kvferry {

struct HostPort {
  std::string host;  // a name or an IP address; IPv6 without brackets
  uint16_t port = 0;

  // "host:port", with brackets around an IPv6 host ("[::1]:80").
  std::string ToString() const;
};

// Splits "host:port", "[v6]:port" or "name:port". The host must be non-empty, an IPv6 host
// must be in brackets, and the port must be decimal digits in 1..65535 (0 too when
// `allow_port_zero`: "pick a free port" for an address to listen on). `what` names the text in
// errors (e.g. "bootstrap address"). Errors: kInvalidArgument naming the text and the problem.
StatusOr<HostPort> ParseHostPort(std::string_view text, std::string_view what = "address",
                                 bool allow_port_zero = false);

// A name for this machine shared by every engine on it: hostname + "/" + boot id.
std::string LocalNodeId();

}  // namespace kvferry
