// `kvferry prefill` / `kvferry decode`: placeholder until the instances land.
#include "tools/commands.h"

namespace kvferry::tools {
void AddInstanceCommands(CLI::App&, RunFn*) {}
}  // namespace kvferry::tools
