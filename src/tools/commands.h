// Subcommands of the `kvferry` tool. Each Add*Command registers its CLI11 subcommand; when the
// subcommand is chosen, parsing sets *run to the function that executes it and returns the
// process exit status.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace kvferry::tools {

using RunFn = std::function<int()>;

void AddReplayCommand(CLI::App& app, RunFn* run);     // replay.cc
void AddInstanceCommands(CLI::App& app, RunFn* run);  // instance.cc: prefill, decode
void AddBenchCommand(CLI::App& app, RunFn* run);      // bench.cc

// The GPU a replay rank runs on (replay.cc). `index` counts the side's ranks (prefill in
// (cp, tp) order). When every rank fits on its own GPU, prefill ranks take GPUs 0..P-1 and decode
// ranks the next D; otherwise prefill shares the first half of the GPUs and decode the rest
// (round robin). With one GPU everything runs on GPU 0.
int ReplayGpu(bool prefill, int index, int prefill_ranks, int decode_ranks, int gpu_count);

}  // namespace kvferry::tools
