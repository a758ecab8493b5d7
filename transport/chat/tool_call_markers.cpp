#include "transport/chat/tool_call_markers.h"

namespace tandem {

std::vector<control_marker> control_markers(const tokenizer& tok, tool_call_format f) {
  std::vector<control_marker> out;
  for (std::string_view m : tool_call_markers(f)) {
    const std::vector<int32_t> ids = tok.encode(m, false, true);
    if (ids.size() == 1 && tok.token_bytes(ids[0]).empty() && tok.token_text(ids[0]) == m)
      out.push_back({ids[0], std::string(m)});
  }
  return out;
}

}  // namespace tandem
