// The command line's authentication flags, shared by every command (replay, bench, prefill,
// decode): `--auth-token-file PATH` and `--insecure` (docs/security.md). The secret itself is
// never a flag, as every user of a machine can read its command lines: it comes from the file
// or from the environment's KVFERRY_AUTH_TOKEN, and reaches child processes through their
// environment.
//
// Thread-safety: plain functions.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "kvferry/status.h"

namespace kvferry::tools {

struct AuthFlags {
  std::string token_file;  // --auth-token-file: a file holding the shared secret
  bool insecure = false;   // --insecure: listen on a non-loopback address without a secret
};

// Adds --auth-token-file and --insecure to `cmd`.
void AddAuthFlags(CLI::App* cmd, AuthFlags* flags);

// The secret: the contents of --auth-token-file when given, else KVFERRY_AUTH_TOKEN, else ""
// (none). Errors name the file or the variable (never the secret).
StatusOr<std::string> ResolveAuthFlags(const AuthFlags& flags);

// This process's environment with KVFERRY_AUTH_TOKEN set to `secret` (left out when empty):
// for a child process, built before fork (execve takes it). Pointers into `storage`.
std::vector<char*> ChildEnvironment(const std::string& secret, std::vector<std::string>* storage);

}  // namespace kvferry::tools
