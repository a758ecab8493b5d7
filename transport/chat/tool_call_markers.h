#pragma once
/// Tool-call markers that are single control tokens of a vocabulary (Mistral's `[TOOL_CALLS]`,
/// Llama 3's `<|python_tag|>`): they decode to no text, so the front end renders them for the
/// tool-call parser only (text_assembler::render_control, tool_call_parser's hidden markers)
/// and a call after one is parsed instead of staying content.
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/tokenizer/tokenizer.h"
#include "transport/chat/tool_call_parser.h"

namespace tandem {

struct control_marker {
  int32_t id = -1;
  std::string text;
};

/// The markers of format `f` that `tok` has as one control token (encoded whole with special
/// tokens parsed, no bytes of their own); empty when the vocabulary spells them as text.
std::vector<control_marker> control_markers(const tokenizer& tok, tool_call_format f);

}  // namespace tandem
