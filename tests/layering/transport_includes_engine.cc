// Must not compile: the transport layer cannot see the engine above it (tests/CMakeLists.txt
// builds this against kvferry_transport and expects the build to fail).
#include "engine/peer.h"
