#include "common/listen_backlog.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace kvferry {

Status RaiseListenBacklog(int fd) {
  if (fd < 0) return InvalidArgumentError("no listening socket to raise the backlog of");
  if (::listen(fd, SOMAXCONN) != 0) {
    return InternalError(std::string("cannot raise the listen backlog: ") + std::strerror(errno));
  }
  return OkStatus();
}

}  // namespace kvferry
