#include "transport/chat/jinja_eval.h"

#include <algorithm>
#include <climits>
#include <cmath>

#include <fmt/format.h>

namespace tandem::jinja {

const value* frame::find(const std::string& name) const {
  for (const frame* f = this; f; f = f->parent.get()) {
    auto it = f->vars.find(name);
    if (it != f->vars.end()) return &it->second;
  }
  return nullptr;
}

struct evaluator::depth_guard {
  depth_guard(evaluator& ev, int line, int col) : ev_(ev) {
    if (++ev_.depth_ > ev_.lim_.max_depth)
      ev_.fail_at(line, col, error_kind::limit,
                  fmt::format("rendering nests deeper than {} levels (recursive macros?)", ev_.lim_.max_depth));
  }
  ~depth_guard() { --ev_.depth_; }
  evaluator& ev_;
};

evaluator::evaluator(const limits& lim, const environment& env) : lim_(lim), env_(env), globals_(builtin_globals()) {}

evaluator::~evaluator() {
  // A namespace may hold itself (`set ns.x = ns`): empty them all to break such cycles.
  for (auto& d : namespaces_) d->items.clear();
}

value evaluator::make_namespace() {
  value v = value::make_dict();
  v.m->is_namespace = true;
  namespaces_.push_back(v.m);
  return v;
}

namespace {

/// Nesting depth of lists and dicts in `v` (namespaces count as leaves); stops past `limit`.
int nesting(const value& v, int limit, uint64_t& visited) {
  ++visited;
  if (limit < 0) return 0;
  int deepest = 0;
  if (v.k == vkind::list) {
    for (auto& x : *v.l) deepest = std::max(deepest, nesting(x, limit - 1, visited));
    return deepest + 1;
  }
  if (v.k == vkind::dict && !v.m->is_namespace) {
    for (auto& [k, x] : v.m->items) deepest = std::max(deepest, nesting(x, limit - 1, visited));
    return deepest + 1;
  }
  return 0;
}

}  // namespace

void evaluator::set_namespace_attr(const value& ns, const std::string& name, value v) {
  uint64_t visited = 0;
  const int depth = nesting(v, lim_.max_depth, visited);
  step(visited / 16);
  if (depth > lim_.max_depth)
    throw op_error{error_kind::limit, fmt::format("namespace attribute '{}' would hold a value nested deeper than {} levels",
                                                  name, lim_.max_depth)};
  ns.m->set(name, std::move(v));
}

void evaluator::fail_at(int line, int col, error_kind kind, const std::string& message) const {
  throw error(kind, fmt::format("template error at line {}, column {}: {}", line, col, message));
}

void evaluator::step(uint64_t cost) {
  steps_ += cost;
  if (steps_ > lim_.max_steps)
    throw op_error{error_kind::limit, fmt::format("the template ran more than {} steps (an endless or huge loop?)", lim_.max_steps)};
}

void evaluator::check_size(size_t bytes) const {
  if (bytes > lim_.max_output_bytes)
    throw op_error{error_kind::limit, fmt::format("a string or list would exceed {} bytes", lim_.max_output_bytes)};
}

std::string evaluator::render(const block& body, const value& context) {
  auto top = std::make_shared<frame>();
  if (context.k == vkind::dict)
    for (auto& [k, v] : context.m->items) top->vars[k] = v;
  std::string out;
  out_ = &out;
  exec(body, top);
  return out;
}

void evaluator::emit(std::string_view s) {
  if (out_->size() + s.size() > lim_.max_output_bytes)
    throw op_error{error_kind::limit, fmt::format("the rendered text would exceed {} bytes", lim_.max_output_bytes)};
  out_->append(s);
}

std::string evaluator::capture(const block& b, const frame_ptr& f) {
  std::string buf;
  std::string* saved = out_;
  out_ = &buf;
  try {
    exec(b, f);
  } catch (...) {
    out_ = saved;
    throw;
  }
  out_ = saved;
  return buf;
}

evaluator::flow evaluator::exec(const block& b, const frame_ptr& f) {
  for (auto& s : b) {
    flow r = exec_stmt(*s, f);
    if (r != flow::normal) return r;
  }
  return flow::normal;
}

evaluator::flow evaluator::exec_stmt(const stmt& s, const frame_ptr& f) {
  depth_guard g(*this, s.line, s.col);
  try {
    step();
    switch (s.op) {
      case sop::text: emit(s.name); break;
      case sop::output: emit(to_str(eval(*s.e[0], f))); break;
      case sop::if_:
        for (size_t i = 0; i < s.e.size(); ++i)
          if (eval(*s.e[i], f).truthy()) return exec(s.bodies[i], f);
        if (s.bodies.size() > s.e.size()) return exec(s.bodies.back(), f);
        break;
      case sop::for_: exec_for(s, f); break;
      case sop::set: assign(*s.e[1], eval(*s.e[0], f), f); break;
      case sop::set_block: {
        value v = value::string(capture(s.bodies[0], f));
        if (s.e[0]) {
          placeholders_.push_back(std::move(v));
          try {
            v = eval(*s.e[0], f);
          } catch (...) {
            placeholders_.pop_back();
            throw;
          }
          placeholders_.pop_back();
        }
        f->vars[s.names[0]] = std::move(v);
        break;
      }
      case sop::macro: f->vars[s.name] = define_macro(s, f); break;
      case sop::filter_block: {
        placeholders_.push_back(value::string(capture(s.bodies[0], f)));
        value v;
        try {
          v = eval(*s.e[0], f);
        } catch (...) {
          placeholders_.pop_back();
          throw;
        }
        placeholders_.pop_back();
        emit(to_str(v));
        break;
      }
      case sop::break_: return flow::break_;
      case sop::continue_: return flow::continue_;
    }
  } catch (const op_error& e) {
    fail_at(s.line, s.col, e.kind, e.message);
  }
  return flow::normal;
}

void evaluator::assign(const expr& target, value v, const frame_ptr& f) {
  if (target.op == eop::name) {
    f->vars[target.name] = std::move(v);
  } else if (target.op == eop::attr) {
    value obj = eval(*target.args[0], f);
    if (obj.k != vkind::dict || !obj.m->is_namespace)
      type_fail(fmt::format("cannot assign attribute '{}' on a {}; only a namespace() has assignable attributes",
                            target.name, type_name(obj)));
    set_namespace_attr(obj, target.name, std::move(v));
  } else {
    auto items = iterate(v);
    if (items.size() != target.args.size())
      type_fail(fmt::format("cannot unpack {} values into {} names", items.size(), target.args.size()));
    for (size_t i = 0; i < items.size(); ++i) assign(*target.args[i], items[i], f);
  }
}

void evaluator::exec_for(const stmt& s, const frame_ptr& f) {
  value seq = eval(*s.e[0], f);
  if (seq.k != vkind::list && seq.k != vkind::dict && seq.k != vkind::string && !seq.undefined())
    type_fail(fmt::format("'{}' object is not iterable", type_name(seq)));
  std::vector<value> all = iterate(seq);
  step(all.size() / 256);
  auto bind = [&](const frame_ptr& fr, const value& item) {
    if (s.names.size() == 1) {
      fr->vars[s.names[0]] = item;
      return;
    }
    auto parts = iterate(item);
    if (parts.size() != s.names.size())
      type_fail(fmt::format("cannot unpack {} values into {} loop variables", parts.size(), s.names.size()));
    for (size_t i = 0; i < parts.size(); ++i) fr->vars[s.names[i]] = parts[i];
  };
  std::vector<value> items;
  if (s.e[1]) {
    for (auto& item : all) {
      step();
      auto fr = std::make_shared<frame>();
      fr->parent = f;
      bind(fr, item);
      if (eval(*s.e[1], fr).truthy()) items.push_back(item);
    }
  } else {
    items = std::move(all);
  }
  if (items.empty()) {
    exec(s.bodies[1], f);
    return;
  }
  const auto n = static_cast<int64_t>(items.size());
  for (int64_t i = 0; i < n; ++i) {
    step();
    auto fr = std::make_shared<frame>();
    fr->parent = f;
    bind(fr, items[static_cast<size_t>(i)]);
    value loop = value::make_dict();
    auto& d = *loop.m;
    d.set("index", value::integer(i + 1));
    d.set("index0", value::integer(i));
    d.set("revindex", value::integer(n - i));
    d.set("revindex0", value::integer(n - i - 1));
    d.set("first", value::boolean(i == 0));
    d.set("last", value::boolean(i == n - 1));
    d.set("length", value::integer(n));
    d.set("depth", value::integer(1));
    d.set("depth0", value::integer(0));
    if (i > 0) d.set("previtem", items[static_cast<size_t>(i - 1)]);
    if (i + 1 < n) d.set("nextitem", items[static_cast<size_t>(i + 1)]);
    fr->vars["loop"] = std::move(loop);
    if (exec(s.bodies[0], fr) == flow::break_) break;
  }
}

value evaluator::define_macro(const stmt& s, const frame_ptr& f) {
  auto c = std::make_shared<callable>();
  c->name = s.name;
  // A weak scope: the macro lives in that scope, and a strong one would make a cycle.
  std::weak_ptr<frame> scope = f;
  const stmt* def = &s;
  c->fn = [this, def, scope](evaluator&, const call_args& a) -> value {
    auto parent = scope.lock();
    if (!parent) type_fail(fmt::format("macro '{}' was called after its scope ended", def->name));
    if (a.pos.size() > def->names.size())
      type_fail(fmt::format("macro '{}' takes not more than {} argument(s)", def->name, def->names.size()));
    auto fr = std::make_shared<frame>();
    fr->parent = parent;
    for (auto& [k, v] : a.kw) {
      bool known = false;
      for (auto& n : def->names) known = known || n == k;
      if (!known) type_fail(fmt::format("macro '{}' takes no keyword argument '{}'", def->name, k));
    }
    for (size_t i = 0; i < def->names.size(); ++i) {
      const value& given = a.get(i, def->names[i]);
      if (!given.undefined() || (i < a.pos.size())) fr->vars[def->names[i]] = given;
      else if (def->e[i]) fr->vars[def->names[i]] = eval(*def->e[i], fr);
      else {
        value u;
        u.s = def->names[i];
        fr->vars[def->names[i]] = u;
      }
    }
    return value::string(capture(def->bodies[0], fr));
  };
  return value::func(std::move(c));
}

value evaluator::call(const value& f, const call_args& args) {
  if (f.k != vkind::func) {
    if (f.undefined()) type_fail(f.s.empty() ? "called an undefined value" : fmt::format("'{}' is undefined", f.s));
    type_fail(fmt::format("'{}' object is not callable", type_name(f)));
  }
  return f.f->fn(*this, args);
}

value evaluator::lookup(const std::string& name, const frame_ptr& f) {
  if (const value* v = f->find(name)) return *v;
  auto it = globals_.find(name);
  if (it != globals_.end()) return it->second;
  value u;
  u.s = name;
  return u;
}

call_args evaluator::eval_args(const expr& e, const frame_ptr& f, size_t first) {
  call_args a;
  for (size_t i = first; i < e.args.size(); ++i) a.pos.push_back(eval(*e.args[i], f));
  for (auto& [k, x] : e.kwargs) a.kw.emplace_back(k, eval(*x, f));
  return a;
}

value evaluator::eval(const expr& e, const frame_ptr& f) {
  depth_guard g(*this, e.line, e.col);
  try {
    step();
    return eval_node(e, f);
  } catch (const op_error& x) {
    fail_at(e.line, e.col, x.kind, x.message);
  }
}

value evaluator::eval_node(const expr& e, const frame_ptr& f) {
  switch (e.op) {
    case eop::literal: return e.lit;
    case eop::name: return lookup(e.name, f);
    case eop::attr: return get_attr(eval(*e.args[0], f), e.name);
    case eop::item: return get_item(eval(*e.args[0], f), eval(*e.args[1], f));
    case eop::slice: {
      value obj = eval(*e.args[0], f);
      value parts[3];
      for (int i = 0; i < 3; ++i)
        if (e.args[static_cast<size_t>(i) + 1]) parts[i] = eval(*e.args[static_cast<size_t>(i) + 1], f);
      return slice(obj, parts[0], parts[1], parts[2]);
    }
    case eop::call: {
      value callee = eval(*e.args[0], f);
      return call(callee, eval_args(e, f, 1));
    }
    case eop::filter: {
      value subject = eval(*e.args[0], f);
      return filter(e.name, subject, eval_args(e, f, 1));
    }
    case eop::test: {
      value subject = eval(*e.args[0], f);
      return value::boolean(test(e.name, subject, eval_args(e, f, 1)) != e.negated);
    }
    case eop::not_: return value::boolean(!eval(*e.args[0], f).truthy());
    case eop::neg:
    case eop::pos: {
      value v = eval(*e.args[0], f);
      if (!v.is_number()) type_fail(fmt::format("bad operand type for unary {}: '{}'", e.op == eop::neg ? '-' : '+', type_name(v)));
      if (e.op == eop::pos) return v.k == vkind::boolean ? value::integer(v.b) : v;
      if (v.k == vkind::real) return value::real(-v.d);
      const int64_t i = v.k == vkind::boolean ? v.b : v.i;
      if (i == INT64_MIN) type_fail("integer overflow");
      return value::integer(-i);
    }
    case eop::binary: {
      value a = eval(*e.args[0], f);
      return binary(e.name, a, eval(*e.args[1], f));
    }
    case eop::and_: {
      value a = eval(*e.args[0], f);
      return a.truthy() ? eval(*e.args[1], f) : a;
    }
    case eop::or_: {
      value a = eval(*e.args[0], f);
      return a.truthy() ? a : eval(*e.args[1], f);
    }
    case eop::compare: {
      value left = eval(*e.args[0], f);
      for (size_t i = 0; i < e.ops.size(); ++i) {
        value right = eval(*e.args[i + 1], f);
        if (!compare(e.ops[i], left, right)) return value::boolean(false);
        left = std::move(right);
      }
      return value::boolean(true);
    }
    case eop::cond:
      if (eval(*e.args[1], f).truthy()) return eval(*e.args[0], f);
      return e.args[2] ? eval(*e.args[2], f) : value();
    case eop::list:
    case eop::tuple: {
      std::vector<value> xs;
      for (auto& a : e.args) xs.push_back(eval(*a, f));
      return value::list(std::move(xs), e.op == eop::tuple);
    }
    case eop::dict: {
      value d = value::make_dict();
      for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
        value k = eval(*e.args[i], f);
        if (k.k != vkind::string) type_fail(fmt::format("dict keys must be strings here, got {}", type_name(k)));
        d.m->set(k.s, eval(*e.args[i + 1], f));
      }
      return d;
    }
    case eop::placeholder: return placeholders_.empty() ? value() : placeholders_.back();
  }
  return value();
}

value evaluator::get_attr(const value& obj, const std::string& name) {
  switch (obj.k) {
    case vkind::undefined:
      type_fail(obj.s.empty() ? fmt::format("cannot read attribute '{}' of an undefined value", name)
                              : fmt::format("'{}' is undefined (reading its attribute '{}')", obj.s, name));
    case vkind::dict: {
      if (!obj.m->is_namespace) {
        value m = builtin_method(obj, name);
        if (!m.undefined()) return m;
      }
      if (const value* v = obj.m->find(name)) return *v;
      break;
    }
    case vkind::string: return builtin_method(obj, name);
    default: break;
  }
  value u;
  u.s = name;
  return u;
}

value evaluator::get_item(const value& obj, const value& key) {
  if (obj.undefined())
    type_fail(obj.s.empty() ? "cannot index an undefined value" : fmt::format("'{}' is undefined (indexing it)", obj.s));
  if (obj.k == vkind::dict && key.k == vkind::string) {
    if (const value* v = obj.m->find(key.s)) return *v;
    return get_attr(obj, key.s);
  }
  if (obj.k == vkind::list && obj.generator) type_fail("'generator' object is not subscriptable");
  if ((obj.k == vkind::list || obj.k == vkind::string) && (key.k == vkind::integer || key.k == vkind::boolean)) {
    int64_t i = key.k == vkind::boolean ? key.b : key.i;
    if (obj.k == vkind::list) {
      const auto n = static_cast<int64_t>(obj.l->size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) return (*obj.l)[static_cast<size_t>(i)];
    } else {
      auto offs = utf8_offsets(obj.s);
      const auto n = static_cast<int64_t>(offs.size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) {
        const size_t b = offs[static_cast<size_t>(i)];
        const size_t end = static_cast<size_t>(i) + 1 < offs.size() ? offs[static_cast<size_t>(i) + 1] : obj.s.size();
        return value::string(obj.s.substr(b, end - b));
      }
    }
  }
  if (key.k == vkind::string) return get_attr(obj, key.s);
  return value();
}

value evaluator::slice(const value& obj, const value& start, const value& stop, const value& stride) {
  auto as_int = [](const value& v, int64_t dflt) -> int64_t {
    if (v.undefined() || v.k == vkind::none) return dflt;
    if (v.k == vkind::boolean) return v.b;
    if (v.k != vkind::integer) type_fail("slice indices must be integers or None");
    return v.i;
  };
  const int64_t st = as_int(stride, 1);
  if (st == 0) type_fail("slice step cannot be zero");
  std::vector<size_t> offs;
  int64_t n;
  if (obj.k == vkind::list && !obj.generator) n = static_cast<int64_t>(obj.l->size());
  else if (obj.k == vkind::string) {
    offs = utf8_offsets(obj.s);
    n = static_cast<int64_t>(offs.size());
  } else {
    type_fail(fmt::format("'{}' object is not subscriptable", type_name(obj)));
  }
  // Python's slice.indices().
  auto clamp = [&](int64_t v) {
    if (v < 0) v += n;
    if (st > 0) return std::clamp<int64_t>(v, 0, n);
    return std::clamp<int64_t>(v, -1, n - 1);
  };
  int64_t a = start.undefined() || start.k == vkind::none ? (st > 0 ? 0 : n - 1) : clamp(as_int(start, 0));
  int64_t b = stop.undefined() || stop.k == vkind::none ? (st > 0 ? n : -1) : clamp(as_int(stop, 0));
  std::vector<int64_t> idx;
  for (int64_t i = a; st > 0 ? i < b : i > b; i += st) idx.push_back(i);
  step(idx.size() / 256);
  if (obj.k == vkind::list) {
    std::vector<value> out;
    for (auto i : idx) out.push_back((*obj.l)[static_cast<size_t>(i)]);
    return value::list(std::move(out), obj.tuple);
  }
  std::string out;
  for (auto i : idx) {
    const size_t from = offs[static_cast<size_t>(i)];
    const size_t to = static_cast<size_t>(i) + 1 < offs.size() ? offs[static_cast<size_t>(i) + 1] : obj.s.size();
    out.append(obj.s, from, to - from);
  }
  return value::string(std::move(out));
}

value evaluator::filter(std::string_view name, const value& v, const call_args& args) {
  return builtin_filter(*this, name, v, args);
}

bool evaluator::test(std::string_view name, const value& v, const call_args& args) {
  return builtin_test(*this, name, v, args);
}

}  // namespace tandem::jinja
