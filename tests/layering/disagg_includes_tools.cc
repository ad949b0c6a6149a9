// Must not compile: the library users link cannot see the tools (replay content).
#include "tools/kv_pattern.h"
