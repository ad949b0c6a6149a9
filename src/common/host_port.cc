#include "common/host_port.h"

#include <unistd.h>

#include <fstream>

namespace kvferry {

std::string HostPort::ToString() const {
  const bool ipv6 = host.find(':') != std::string::npos;
  return (ipv6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

StatusOr<HostPort> ParseHostPort(std::string_view text, std::string_view what,
                                 bool allow_port_zero) {
  auto bad = [&](std::string_view why) {
    return InvalidArgumentError(std::string(what) + " '" + std::string(text) + "' " +
                                std::string(why));
  };
  const size_t colon = text.rfind(':');
  if (colon == std::string_view::npos) return bad("is not host:port");
  std::string_view host = text.substr(0, colon);
  const std::string_view port = text.substr(colon + 1);
  if (!host.empty() && host.front() == '[') {
    if (host.size() < 3 || host.back() != ']') return bad("has an unclosed or empty [IPv6] host");
    host = host.substr(1, host.size() - 2);
  } else if (host.find(':') != std::string_view::npos) {
    return bad("has an IPv6 host without brackets (write [host]:port)");
  }
  if (host.empty()) return bad("has no host");
  if (port.empty()) return bad("has no port");
  uint32_t value = 0;
  for (char c : port) {
    if (c < '0' || c > '9') return bad("has a port that is not a decimal number");
    value = value * 10 + static_cast<uint32_t>(c - '0');
    if (value > 65535) return bad("has a port above 65535");
  }
  if (value == 0 && !allow_port_zero) return bad("has port 0");
  return HostPort{std::string(host), static_cast<uint16_t>(value)};
}

std::string LocalNodeId() {
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  std::string boot_id;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, boot_id);
  return std::string(host) + "/" + boot_id;
}

}  // namespace kvferry
