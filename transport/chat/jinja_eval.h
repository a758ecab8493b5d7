#pragma once
/// The Jinja tree-walking evaluator (internal to transport/chat/jinja.cpp): statements,
/// expressions and operators here, filters/tests/methods/globals in jinja_builtins.cpp.
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "transport/chat/jinja.h"

namespace tandem::jinja {

/// One scope: a macro call, a loop iteration, or the template's top level.
struct frame {
  std::unordered_map<std::string, value> vars;
  std::shared_ptr<frame> parent;
  const value* find(const std::string& name) const;
};
using frame_ptr = std::shared_ptr<frame>;

class evaluator {
 public:
  evaluator(const limits& lim, const environment& env);
  ~evaluator();
  evaluator(const evaluator&) = delete;
  evaluator& operator=(const evaluator&) = delete;

  /// Renders `body` with the dict `context` as the top-level variables.
  std::string render(const block& body, const value& context);

  /// Calls a function value.
  value call(const value& f, const call_args& args);
  /// Applies the named filter / test (used by map, select and friends too).
  value filter(std::string_view name, const value& v, const call_args& args);
  bool test(std::string_view name, const value& v, const call_args& args);
  /// `obj.name` and `obj[key]` with jinja2's fallbacks (attribute then item, or the reverse).
  value get_attr(const value& obj, const std::string& name);
  value get_item(const value& obj, const value& key);
  /// `a op b` for == != < <= > >= in notin.
  bool compare(const std::string& op, const value& a, const value& b);
  /// Counts work against limits.max_steps.
  void step(uint64_t cost = 1);
  /// Rejects a string or list bigger than the limits.
  void check_size(size_t bytes) const;
  /// A new namespace (tracked so that a namespace holding itself is freed after the render).
  value make_namespace();
  /// Stores `v` as attribute `name` of the namespace `ns`, rejecting values nested deeper
  /// than limits.max_depth: a namespace is the only way a value survives a loop iteration,
  /// so this bounds how deep any value can grow (and how deep its destruction recurses).
  void set_namespace_attr(const value& ns, const std::string& name, value v);
  const environment& env() const { return env_; }
  const limits& lim() const { return lim_; }

 private:
  enum class flow { normal, break_, continue_ };
  struct depth_guard;

  flow exec(const block& b, const frame_ptr& f);
  flow exec_stmt(const stmt& s, const frame_ptr& f);
  void exec_for(const stmt& s, const frame_ptr& f);
  void assign(const expr& target, value v, const frame_ptr& f);
  value define_macro(const stmt& s, const frame_ptr& f);
  std::string capture(const block& b, const frame_ptr& f);
  void emit(std::string_view s);

  value eval(const expr& e, const frame_ptr& f);
  value eval_node(const expr& e, const frame_ptr& f);
  value lookup(const std::string& name, const frame_ptr& f);
  call_args eval_args(const expr& e, const frame_ptr& f, size_t first);
  value binary(const std::string& op, const value& a, const value& b);
  value slice(const value& obj, const value& start, const value& stop, const value& stride);

  [[noreturn]] void fail_at(int line, int col, error_kind kind, const std::string& message) const;

  const limits& lim_;
  const environment& env_;
  std::string* out_ = nullptr;
  uint64_t steps_ = 0;
  int depth_ = 0;
  std::vector<value> placeholders_;
  /// Every namespace of this render, held until the end: emptying them there frees cycles
  /// (`set ns.x = ns`) and chains of namespaces without deep recursive destruction.
  std::vector<dict_ptr> namespaces_;
  std::unordered_map<std::string, value> globals_;
};

/// Filters, tests, methods and globals (jinja_builtins.cpp).
value builtin_filter(evaluator& ev, std::string_view name, const value& v, const call_args& a);
bool builtin_test(evaluator& ev, std::string_view name, const value& v, const call_args& a);
/// `obj.name` as a bound method (str.strip, dict.items, ...), or undefined.
value builtin_method(const value& obj, const std::string& name);
/// The global functions: range, namespace, dict, raise_exception, strftime_now.
std::unordered_map<std::string, value> builtin_globals();
/// Items of an iterable as a for loop sees them (dict: keys; string: characters).
std::vector<value> iterate(const value& v);

}  // namespace tandem::jinja
