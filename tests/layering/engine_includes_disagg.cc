// Must not compile: the engine cannot see the connector's public headers above it.
#include "kvferry/connector.h"
