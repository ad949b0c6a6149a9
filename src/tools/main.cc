// Entry point of the `kvferry` command-line tool.
#include "tools/cli.h"

int main(int argc, char** argv) { return kvferry::tools::RunCli(argc, argv); }
