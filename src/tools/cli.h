// The `kvferry` command-line tool: subcommands replay, bench, prefill, decode.
#pragma once

namespace kvferry::tools {
// Parses argv, runs the chosen subcommand, returns the process exit status.
int RunCli(int argc, char** argv);
}  // namespace kvferry::tools
