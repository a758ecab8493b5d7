// libFuzzer target: the JSON-schema compiler and the grammar matcher (kernels/grammar) on
// arbitrary schemas, since response_format's schema comes from the client: parsing, compiling
// (refs, recursion, repetition bounds), and the mask and byte walk of the compiled grammar must
// never crash, hang or grow without bound; every refusal is a tandem::error.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/grammar/json_schema.h"
#include "kernels/grammar/matcher.h"

namespace {

std::shared_ptr<const tandem::grammar::token_trie> vocab() {
  static const auto v = [] {
    std::vector<std::string> t;
    for (int c = 0; c < 256; ++c) t.emplace_back(1, char(c));
    for (const char* s : {"{\"", "\":", "\",", "true", "false", "null", "12", "\"}", "  ", "\n"}) t.emplace_back(s);
    t.emplace_back("");  // EOS
    return std::make_shared<const tandem::grammar::token_trie>(t, int32_t(t.size() - 1));
  }();
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  // The schema is everything before the first NUL; what follows is walked byte by byte.
  const size_t cut = in.find('\0');
  const std::string_view schema = in.substr(0, cut), walk = cut == in.npos ? std::string_view() : in.substr(cut + 1);
  tandem::grammar::schema_limits lim;
  lim.max_elements = 1 << 14;
  lim.max_repeat = 64;
  try {
    tandem::grammar::automaton a(tandem::grammar::compile_json_schema(schema, lim), vocab(),
                                 {.max_stacks = 1 << 14, .max_mask_bytes = 1 << 20, .max_memo = 1 << 14});
    tandem::grammar::state s = a.initial(), next;
    a.mask(s);
    for (char c : walk) {
      a.advance_byte(s, uint8_t(c), next);
      if (next.empty()) break;
      s.swap(next);
      a.mask(s);
    }
  } catch (const tandem::error&) {
  }
  return 0;
}
