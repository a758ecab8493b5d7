// The tool-call parser on arbitrary model output: never crashes, and the content and calls do
// not depend on how the text is split into pieces (the first byte picks the format and the
// split points).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "transport/chat/tool_call_parser.h"

using namespace tandem;

namespace {

struct outcome {
  std::string content;
  std::vector<parsed_tool_call> calls;
};

void take(outcome& o, tool_call_parser::result r) {
  o.content += r.content;
  for (auto& c : r.calls) o.calls.push_back(std::move(c));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const auto f = static_cast<tool_call_format>(data[0] % 4);
  const size_t step = 1 + data[1] % 7;
  const std::string text(reinterpret_cast<const char*>(data + 2), size - 2);
  outcome whole, pieces;
  tool_call_parser a(f), b(f);
  take(whole, a.push(text));
  take(whole, a.finish());
  for (size_t i = 0; i < text.size(); i += step) take(pieces, b.push(std::string_view(text).substr(i, step)));
  take(pieces, b.finish());
  if (whole.content != pieces.content || whole.calls.size() != pieces.calls.size()) std::abort();
  for (size_t i = 0; i < whole.calls.size(); ++i)
    if (whole.calls[i].name != pieces.calls[i].name || whole.calls[i].arguments != pieces.calls[i].arguments) std::abort();
  return 0;
}
