#include "tools/cli.h"

#include <cstdio>

namespace kvferry::tools {
int RunCli(int argc, char** argv) {
  (void)argc;
  (void)argv;
  std::fprintf(stderr, "kvferry: not built yet\n");
  return 2;
}
}  // namespace kvferry::tools
