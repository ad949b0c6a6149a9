// Two "nodes" on one machine for tests of inter-node transports: this process's network
// namespace and a new one, joined by a veth pair. Needs root and `ip` (iproute2); where they
// cannot be made, ok() is false and why() says why (tests skip with it).
//
// UCX sees both namespaces as one host (same host name and boot id), so it would also offer
// and try each side's loopback address, which leads back into the caller's own namespace:
// UCX tests name the veth end of each side in UCX_NET_DEVICES.
#pragma once

#include <string>

namespace kvferry::testutil {

class VethNamespace {
 public:
  // Creates namespace "kvf<tag><pid>" and the pair "kva<pid>" (here, 10.<x>.<y>.1/24) and
  // "kvb<pid>" (in the namespace, .2/24), on a /24 no route of this host uses yet.
  explicit VethNamespace(const std::string& tag);
  ~VethNamespace();  // deletes the namespace (and with it the veth pair)
  VethNamespace(const VethNamespace&) = delete;
  VethNamespace& operator=(const VethNamespace&) = delete;

  bool ok() const { return ok_; }
  const std::string& why() const { return why_; }
  const std::string& ns() const { return ns_; }
  const std::string& local_ip() const { return local_ip_; }
  const std::string& local_device() const { return local_device_; }
  const std::string& ns_ip() const { return ns_ip_; }
  const std::string& ns_device() const { return ns_device_; }

 private:
  bool ok_ = false;
  std::string why_;
  std::string ns_, local_ip_, local_device_, ns_ip_, ns_device_;
};

// Moves the calling process, which must be single-threaded (a child just forked), into network
// namespace `name` with its own view of /sys (as `ip netns exec` does: UCX lists network
// devices there). Returns an empty string, or what failed.
std::string EnterNetnsInChild(const std::string& name);

}  // namespace kvferry::testutil
