#include "testutil/netns.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <unistd.h>

#include "testutil/run_command.h"

namespace kvferry::testutil {
namespace {

// Deletes namespace `ns` (its veth end with it) and the host's end `device`, whichever exist.
void Remove(const std::string& ns, const std::string& device) {
  RunCommand("ip netns del " + ns + " 2>/dev/null; ip link del " + device + " 2>/dev/null");
}

}  // namespace

VethNamespace::VethNamespace(const std::string& tag) {
  const int pid = static_cast<int>(::getpid());
  ns_ = "kvf" + tag + std::to_string(pid);
  local_device_ = "kva" + std::to_string(pid % 1000000);  // at most 15 characters
  ns_device_ = "kvb" + std::to_string(pid % 1000000);
  if (::geteuid() != 0) {
    why_ = "network namespaces need root";
    return;
  }
  // A /24 no route of this host uses yet (a namespace left by a killed run keeps its route, and
  // a second route to the same subnet would send this pair's packets to the other), starting
  // from one derived from the pid.
  std::string subnet;
  for (int i = 0; i < 250 && subnet.empty(); ++i) {
    const int n = pid + i * 50;
    const std::string candidate =
        "10." + std::to_string(200 + n % 50) + "." + std::to_string((n / 50) % 250) + ".";
    const CommandResult routes = RunCommand("ip route show to match " + candidate + "1 2>&1");
    if (routes.exit_code == 0 && routes.output.find(candidate) == std::string::npos) {
      subnet = candidate;
    }
  }
  if (subnet.empty()) {
    why_ = "no free 10.x.y.0/24 subnet for a veth pair";
    return;
  }
  local_ip_ = subnet + "1";
  ns_ip_ = subnet + "2";
  const std::string script =
      "set -e; ip netns add " + ns_ + "; ip link add " + local_device_ + " type veth peer name " +
      ns_device_ + "; ip link set " + ns_device_ + " netns " + ns_ + "; ip addr add " + local_ip_ +
      "/24 dev " + local_device_ + "; ip link set " + local_device_ + " up; ip -n " + ns_ +
      " addr add " + ns_ip_ + "/24 dev " + ns_device_ + "; ip -n " + ns_ + " link set " +
      ns_device_ + " up; ip -n " + ns_ + " link set lo up";
  CommandResult r = RunCommand(script + " 2>&1");
  if (r.exit_code != 0) {
    why_ = "cannot create a network namespace: " + r.output;
    Remove(ns_, local_device_);
    return;
  }
  // Both ends operationally up (RUNNING) before anyone looks for them: the kernel marks a
  // veth running a moment after `ip link set up` (its link watch runs later), and UCX's tcp
  // transport leaves out devices that are not running yet ("network device ... is not
  // available", seen once in CI).
  const std::string running = "ip -o link show dev " + local_device_ +
                              " | grep -q 'state UP' && ip -n " + ns_ + " -o link show dev " +
                              ns_device_ + " | grep -q 'state UP'";
  bool up = false;
  for (int i = 0; i < 300 && !up; ++i) {
    up = RunCommand(running).exit_code == 0;
    if (!up) ::usleep(10000);
  }
  if (!up) {
    why_ = "the veth pair " + local_device_ + " / " + ns_device_ + " did not come up: " +
           RunCommand("ip -o link show dev " + local_device_ + "; ip -n " + ns_ +
                      " -o link show dev " + ns_device_ + " 2>&1")
               .output;
    Remove(ns_, local_device_);
    return;
  }
  ok_ = true;
}

VethNamespace::~VethNamespace() { Remove(ns_, local_device_); }

std::string EnterNetnsInChild(const std::string& name) {
  const std::string path = "/var/run/netns/" + name;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0) return "cannot enter " + path;
  ::close(fd);
  if (::unshare(CLONE_NEWNS) != 0) return "unshare(CLONE_NEWNS) failed";
  if (::mount(nullptr, "/", nullptr, MS_SLAVE | MS_REC, nullptr) != 0) {
    return "cannot make / a slave mount";
  }
  ::umount2("/sys", MNT_DETACH);
  if (::mount(name.c_str(), "/sys", "sysfs", 0, nullptr) != 0) return "cannot mount /sys";
  return "";
}

}  // namespace kvferry::testutil
