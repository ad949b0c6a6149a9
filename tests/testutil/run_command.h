// Runs a shell command (the real `kvferry` binary) and captures its output and exit code.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>

namespace kvferry::testutil {

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

CommandResult RunCommand(const std::string& command);

// Path of the built `kvferry` binary.
inline std::string KvferryBinary() { return KVFERRY_BINARY; }
// The shared data folder beside the repository (traces, models).
inline std::string SharedDir() { return std::string(KVFERRY_SOURCE_DIR) + "/../shared"; }
inline std::string SourceDir() { return KVFERRY_SOURCE_DIR; }
// A path in the temporary folder, "kvferry-<prefix>-<pid>-<name>", unique to this process.
inline std::string TempPath(const std::string& prefix, const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("kvferry-" + prefix + "-" + std::to_string(::getpid()) + "-" + name))
      .string();
}

}  // namespace kvferry::testutil
