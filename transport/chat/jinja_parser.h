#pragma once
/// Jinja parser: tokens (jinja_lexer.h) into a tree (jinja_ast.h), with jinja2's operator
/// precedence (filters and tests bind tighter than arithmetic, `not` looser than comparisons).
/// Supports the tags chat templates use: if/elif/else, for (else, `if` filter, tuple
/// targets), set (with namespace attributes and block form), macro, filter, break, continue.
#include <vector>

#include "transport/chat/jinja_ast.h"
#include "transport/chat/jinja_lexer.h"

namespace tandem::jinja {

/// Parses `tokens`; throws error(syntax) naming the line and column, or error(limit) past
/// `max_depth` levels of nesting (blocks and expressions together).
block parse(const std::vector<token>& tokens, int max_depth);

}  // namespace tandem::jinja
