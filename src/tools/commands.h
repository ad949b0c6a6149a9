// Subcommands of the `kvferry` tool. Each Add*Command registers its CLI11 subcommand; when the
// subcommand is chosen, parsing sets *run to the function that executes it and returns the
// process exit status.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace kvferry::tools {

using RunFn = std::function<int()>;

void AddReplayCommand(CLI::App& app, RunFn* run);    // replay.cc
void AddInstanceCommands(CLI::App& app, RunFn* run);  // instance.cc: prefill, decode
void AddBenchCommand(CLI::App& app, RunFn* run);     // bench.cc

}  // namespace kvferry::tools
