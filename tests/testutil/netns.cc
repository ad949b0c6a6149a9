#include "testutil/netns.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <unistd.h>

#include "testutil/run_command.h"

namespace kvferry::testutil {

VethNamespace::VethNamespace(const std::string& tag) {
  const int pid = static_cast<int>(::getpid());
  ns_ = "kvf" + tag + std::to_string(pid);
  local_device_ = "kva" + std::to_string(pid % 1000000);  // at most 15 characters
  ns_device_ = "kvb" + std::to_string(pid % 1000000);
  const std::string subnet =
      "10." + std::to_string(200 + pid % 50) + "." + std::to_string((pid / 50) % 250) + ".";
  local_ip_ = subnet + "1";
  ns_ip_ = subnet + "2";
  if (::geteuid() != 0) {
    why_ = "network namespaces need root";
    return;
  }
  const std::string script =
      "set -e; ip netns add " + ns_ + "; ip link add " + local_device_ + " type veth peer name " +
      ns_device_ + "; ip link set " + ns_device_ + " netns " + ns_ + "; ip addr add " + local_ip_ +
      "/24 dev " + local_device_ + "; ip link set " + local_device_ + " up; ip -n " + ns_ +
      " addr add " + ns_ip_ + "/24 dev " + ns_device_ + "; ip -n " + ns_ + " link set " +
      ns_device_ + " up; ip -n " + ns_ + " link set lo up";
  CommandResult r = RunCommand(script + " 2>&1");
  if (r.exit_code != 0) {
    why_ = "cannot create a network namespace: " + r.output;
    RunCommand("ip netns del " + ns_ + " 2>/dev/null; ip link del " + local_device_ +
               " 2>/dev/null");
    return;
  }
  ok_ = true;
}

VethNamespace::~VethNamespace() {
  RunCommand("ip netns del " + ns_ + " 2>/dev/null; ip link del " + local_device_ + " 2>/dev/null");
}

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
