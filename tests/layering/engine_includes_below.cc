// Must compile: a layer sees its own headers and those of every layer below it (the control
// test for the probes that must fail).
#include "common/host_port.h"
#include "cuda/device_ops.h"
#include "engine/peer.h"
#include "kvferry/engine.h"
#include "transport/transport_set.h"
