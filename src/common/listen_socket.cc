#include "common/listen_socket.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace kvferry {

void SetListenAddressReuse(int fd) {
  int yes = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
}

Status RaiseListenBacklog(int fd) {
  if (fd < 0) return InvalidArgumentError("no listening socket to raise the backlog of");
  if (::listen(fd, SOMAXCONN) != 0) {
    return InternalError(std::string("cannot raise the listen backlog: ") + std::strerror(errno));
  }
  return OkStatus();
}

}  // namespace kvferry
