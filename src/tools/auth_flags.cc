#include "tools/auth_flags.h"

#include <unistd.h>

#include "common/auth.h"
#include "common/checks.h"

extern char** environ;

namespace kvferry::tools {

void AddAuthFlags(CLI::App* cmd, AuthFlags* flags) {
  cmd->add_option("--auth-token-file", flags->token_file,
                  "File holding the deployment's shared secret (default: KVFERRY_AUTH_TOKEN); "
                  "engines, bootstrap and control servers then admit only peers that prove it");
  cmd->add_flag("--insecure", flags->insecure,
                "Allow listening on a non-loopback address without a shared secret");
}

StatusOr<std::string> ResolveAuthFlags(const AuthFlags& flags) {
  if (!flags.token_file.empty()) return ReadAuthSecretFile(flags.token_file);
  return ResolveAuthSecret("");
}

std::vector<char*> ChildEnvironment(const std::string& secret, std::vector<std::string>* storage) {
  constexpr std::string_view kName = "KVFERRY_AUTH_TOKEN=";
  storage->clear();
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    if (std::string_view(*e).substr(0, kName.size()) != kName) storage->emplace_back(*e);
  }
  if (!secret.empty()) storage->push_back(std::string(kName) + secret);
  std::vector<char*> env;
  env.reserve(storage->size() + 1);
  for (std::string& s : *storage) env.push_back(s.data());
  env.push_back(nullptr);
  return env;
}

}  // namespace kvferry::tools
