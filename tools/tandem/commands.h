#pragma once
/// Subcommands of the `tandem` binary. Each takes the arguments after its name and
/// returns the process exit code.
#include <span>
#include <string>

namespace tandem::cli {

using args = std::span<const std::string>;

int serve(args a);         ///< run a node (embedded single-process cluster without --config)
int check_config(args a);  ///< validate a config without starting anything
int inspect(args a);       ///< show the actors of a running node
int bench(args a);         ///< benchmarks (model, control-plane, transfer, cache, serve)
int make_model(args a);    ///< write a random-weight Llama GGUF
int generate(args a);      ///< RPC client: stream a completion from a running node
int tokenize(args a);      ///< text on stdin to token ids with a model's tokenizer

}  // namespace tandem::cli
