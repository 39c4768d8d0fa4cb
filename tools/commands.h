// Subcommands of the `sparse-mla` command line.
#pragma once

namespace sparse_mla::tools {

int run_command(int argc, char** argv);    // sparse-mla run: one simulated DeepSeek-V4 decode step
int bench_command(int argc, char** argv);  // sparse-mla bench: the benchmark suite

}  // namespace sparse_mla::tools
