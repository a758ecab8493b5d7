// Entry point: dispatches to a subcommand. `main` is the only place that wires things.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "kernels/base/error.h"
#include "tools/tandem/commands.h"

namespace {

void usage() {
  std::fputs(
      "usage: tandem <command> [options]\n"
      "\n"
      "commands:\n"
      "  serve         run a node; without --config, an embedded single-process cluster\n"
      "  check-config  validate a cluster config and exit (0 valid, 1 invalid, 2 usage error)\n"
      "  inspect       list the actors, requests and KV pools of a running node\n"
      "  bench         benchmarks: model | control-plane | transfer | cache | serve\n"
      "  make-model    write a random-weight Llama GGUF (--preset tiny-15m|small-110m)\n"
      "  generate      stream a completion from a running node over Cap'n Proto RPC\n"
      "  tokenize      print the token ids of the text on stdin (--model FILE)\n"
      "\n"
      "run 'tandem <command> --help' for the options of a command\n",
      stderr);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    usage();
    return 2;
  }
  std::string cmd = argv[1];
  std::vector<std::string> rest(argv + 2, argv + argc);
  try {
    if (cmd == "serve") return tandem::cli::serve(rest);
    if (cmd == "check-config") return tandem::cli::check_config(rest);
    if (cmd == "inspect") return tandem::cli::inspect(rest);
    if (cmd == "bench") return tandem::cli::bench(rest);
    if (cmd == "make-model") return tandem::cli::make_model(rest);
    if (cmd == "generate") return tandem::cli::generate(rest);
    if (cmd == "tokenize") return tandem::cli::tokenize(rest);
    if (cmd == "--help" || cmd == "-h" || cmd == "help") {
      usage();
      return 0;
    }
    std::fprintf(stderr, "tandem: unknown command '%s'\n", cmd.c_str());
    usage();
    return 2;
  } catch (const tandem::error& e) {
    std::fprintf(stderr, "tandem %s: error (%s): %s\n", cmd.c_str(),
                 std::string(tandem::to_string(e.kind())).c_str(), e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandem %s: error: %s\n", cmd.c_str(), e.what());
    return 1;
  }
}
