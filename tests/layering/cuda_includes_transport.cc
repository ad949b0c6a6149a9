// Must not compile: the cuda layer cannot see the transports above it.
#include "transport/transport.h"
