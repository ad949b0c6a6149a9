#include "tools/cli.h"

#include <cstdio>

#include "common/env.h"
#include "tools/commands.h"

namespace kvferry::tools {

int RunCli(int argc, char** argv) {
  CLI::App app{
      "kvferry: moves KV cache from prefill to decode instances of a disaggregated LLM server"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "kvferry 0.1.0");
  RunFn run;
  AddReplayCommand(app, &run);
  AddInstanceCommands(app, &run);
  AddBenchCommand(app, &run);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (auto env = ReadEnvConfig(); !env.ok()) {
    std::fprintf(stderr, "kvferry: %s\n", env.status().message().c_str());
    return 2;
  }
  return run ? run() : 2;
}

}  // namespace kvferry::tools
