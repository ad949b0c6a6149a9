// `kvferry bench`: placeholder until the benchmark lands.
#include "tools/commands.h"

namespace kvferry::tools {
void AddBenchCommand(CLI::App& app, RunFn* run) {
  auto* cmd = app.add_subcommand("bench", "Transfer-engine benchmark between two processes");
  cmd->callback([run] { *run = [] { return 2; }; });
}
}  // namespace kvferry::tools
