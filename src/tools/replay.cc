// `kvferry replay`: placeholder until the replay lands.
#include "tools/commands.h"

namespace kvferry::tools {
void AddReplayCommand(CLI::App&, RunFn*) {}
}  // namespace kvferry::tools
