// The backlog of a listening TCP socket, raised for bursts of connections.
//
// cpp-httplib 0.11 (Debian's, compiled into its shared library) listens with a backlog of 5.
// When more clients than that connect at once (a replay's 32 workers starting together; many
// decode ranks registering with one bootstrap server), the accept queue overflows: the kernel
// drops SYNs, then answers the retransmitted ones with SYN cookies while it still drops their
// ACK and first data segment, so the client believes it is connected and sends; a later
// segment (httplib writes a request's headers and body separately) cannot complete a cookie,
// and the kernel resets the connection. The client sees a read error, the server never sees
// the request (docs/perf/nvlink-h100.md, session 21). Our servers raise the backlog after
// binding.
//
// Thread-safety: a plain function.
#pragma once

#include "kvferry/status.h"

namespace kvferry {

// Sets the backlog of listening socket `fd` to SOMAXCONN (on Linux, listen() on a socket that
// already listens changes only its backlog; the kernel caps it at net.core.somaxconn).
// Errors: kInvalidArgument for a negative fd, kInternal with errno's text when listen fails.
Status RaiseListenBacklog(int fd);

}  // namespace kvferry
