#pragma once
/// A small Jinja interpreter for chat templates (`tokenizer.chat_template` in GGUF files).
/// It renders like jinja2's ImmutableSandboxedEnvironment with trim_blocks=True and
/// lstrip_blocks=True plus Hugging Face's globals (raise_exception, strftime_now) and its
/// `tojson` (json.dumps with ensure_ascii=False), which is how the models' own tokenizers
/// render them. Covers expressions, filters, tests, string/dict methods, if/for/set/macro/
/// filter blocks, loop controls and namespaces; not template inheritance, includes or
/// imports (a chat template is one string).
///
/// Templates may come from untrusted model files, so every render is bounded: template
/// size, nesting, steps (loop iterations and evaluations), output and string sizes. A bound
/// that is hit is an error(limit) naming it; nothing else (recursion, huge repeats, cycles)
/// can crash or hang the process.
#include <cstdint>
#include <ctime>
#include <functional>
#include <string>
#include <string_view>

#include "transport/chat/jinja_ast.h"
#include "transport/chat/jinja_value.h"

namespace tandem::json {
struct value;
}

namespace tandem::jinja {

/// Bounds on parsing and rendering one template.
struct limits {
  size_t max_template_bytes = 1 << 20;
  size_t max_tokens = 1 << 18;
  /// Nesting of blocks and expressions in the parser, and of evaluation (macro calls count
  /// their whole body) in the renderer.
  int max_depth = 256;
  /// Loop iterations, statements and expression evaluations, plus one per 256 bytes or
  /// items a string or list operation produces.
  uint64_t max_steps = 4'000'000;
  /// Rendered output and any one string or list built while rendering.
  size_t max_output_bytes = 4 << 20;
  size_t max_list_items = 1 << 16;
};

/// What a render may see of the outside world.
struct environment {
  /// The time strftime_now() formats (UTC); tests inject a fixed one.
  std::function<std::time_t()> now = [] { return std::time(nullptr); };
};

/// A parsed template. render() is const and keeps no state between renders, so one parsed
/// template serves every request.
class template_ {
 public:
  /// Parses `source`; throws error(syntax) with line and column, or error(limit).
  explicit template_(std::string_view source, limits lim = {});

  /// Renders with the variables of `context` (a dict). Throws error(render|raised|limit)
  /// naming the template line and column.
  std::string render(const value& context, const environment& env = {}) const;

 private:
  limits lim_;
  block body_;
};

/// Converts JSON text to a value (objects keep their key order, integers stay integers).
/// Throws error(render) naming what is wrong with the JSON.
value from_json(std::string_view json);
/// Converts a parsed JSON value (kernels/base/json.h).
value from_json(const json::value& j);

}  // namespace tandem::jinja
