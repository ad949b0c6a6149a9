// The UCX transport in a build without UCX: Create says how to get it.
#include "transport/ucx/ucx_transport.h"

namespace kvferry {

bool UcxBuilt() { return false; }

StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(const UcxTransportOptions&,
                                                        MemoryRegistry*) {
  return UnimplementedError(
      "transport 'ucx' is not in this build (configure with -DKVFERRY_WITH_UCX=ON and "
      "Debian's libucx-dev installed)");
}

}  // namespace kvferry
