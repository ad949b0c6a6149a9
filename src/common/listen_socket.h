// Options of our HTTP servers' listening sockets (set from cpp-httplib's socket-options
// callback, which is called for each socket it tries to bind; the last one is the one bound).
//
// Address reuse: SO_REUSEADDR only, so that a restarted server can rebind while old
// connections sit in TIME_WAIT. httplib's default sets SO_REUSEPORT instead, which would let a
// second server bind the same port and silently receive part of the requests.
//
// The backlog, raised for bursts of connections:
// cpp-httplib 0.11 (Debian's, compiled into its shared library) listens with a backlog of 5.
// When more clients than that connect at once (a replay's 32 workers starting together; many
// decode ranks registering with one bootstrap server), the accept queue overflows: the kernel
// drops SYNs, then answers the retransmitted ones with SYN cookies while it still drops their
// ACK and first data segment, so the client believes it is connected and sends; a later
// segment (httplib writes a request's headers and body separately) cannot complete a cookie,
// and the kernel resets the connection. The client sees a read error, the server never sees
// the request (docs/perf/nvlink-h100-s21-s22.md, "A stall at concurrency 32"). Our servers raise
// the backlog after binding.
//
// Thread-safety: plain functions.
#pragma once

#include "kvferry/status.h"

namespace kvferry {

// Sets SO_REUSEADDR on socket `fd` (before bind), and no other option. Errors are left to the
// bind that follows.
void SetListenAddressReuse(int fd);

// Sets the backlog of listening socket `fd` to SOMAXCONN (on Linux, listen() on a socket that
// already listens changes only its backlog; the kernel caps it at net.core.somaxconn).
// Errors: kInvalidArgument for a negative fd, kInternal with errno's text when listen fails.
Status RaiseListenBacklog(int fd);

}  // namespace kvferry
