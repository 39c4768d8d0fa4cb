// `sparse-mla`: the command line. Dispatches to the subcommands of tools/commands.h.
#include <cstdio>
#include <cstring>
#include <new>

#include "tools/commands.h"

namespace {

void print_usage(FILE* to) {
  std::fprintf(to,
               "usage: sparse-mla <command> [options]\n"
               "commands:\n"
               "  run     one simulated DeepSeek-V4 decode step, verified against the reference\n"
               "  bench   the benchmark suite\n"
               "Run `sparse-mla <command> --help` for a command's options.\n");
}

int dispatch(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    print_usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (!std::strcmp(argv[1], "run")) return sparse_mla::tools::run_command(argc - 1, argv + 1);
  if (!std::strcmp(argv[1], "bench")) return sparse_mla::tools::bench_command(argc - 1, argv + 1);
  std::fprintf(stderr, "sparse-mla: unknown command '%s'\n", argv[1]);
  print_usage(stderr);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  // The commands size their host arrays by the options; the memory checks before them are
  // estimates, so an allocation that still fails ends the command with a message.
  try {
    return dispatch(argc, argv);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "sparse-mla: out of host memory; try a smaller --batch or --context\n");
    return 1;
  }
}
