#include "transport/chat/chat_template.h"

#include "kernels/base/json.h"

namespace tandem {

chat_template::chat_template(std::string_view source, std::string bos_token, std::string eos_token, jinja::limits lim)
    : tmpl_(source, lim), bos_(std::move(bos_token)), eos_(std::move(eos_token)) {}

namespace {

/// A tool call's arguments: the parsed object when asked and the text is a JSON object.
jinja::value arguments_value(const std::string& text, bool as_object) {
  if (as_object) {
    try {
      json::value j = json::parse(text);
      if (j.k == json::kind::object) return jinja::from_json(j);
    } catch (const json::parse_error&) {
      // Not JSON: the template gets the text as sent.
    }
  }
  return jinja::value::string(text);
}

/// A message as a dict with only the keys the request had, as Hugging Face passes them
/// (templates test `message.tool_calls is defined` and the like).
jinja::value message_value(const chat_message& m, bool object_arguments) {
  jinja::value d = jinja::value::make_dict();
  d.m->set("role", jinja::value::string(m.role));
  d.m->set("content", m.content_null ? jinja::value::none() : jinja::value::string(m.content));
  if (!m.tool_calls.empty()) {
    std::vector<jinja::value> calls;
    for (auto& c : m.tool_calls) {
      jinja::value fn = jinja::value::make_dict();
      fn.m->set("name", jinja::value::string(c.name));
      fn.m->set("arguments", arguments_value(c.arguments, object_arguments));
      jinja::value call = jinja::value::make_dict();
      call.m->set("id", jinja::value::string(c.id));
      call.m->set("type", jinja::value::string("function"));
      call.m->set("function", fn);
      calls.push_back(call);
    }
    d.m->set("tool_calls", jinja::value::list(std::move(calls)));
  }
  if (!m.tool_call_id.empty()) d.m->set("tool_call_id", jinja::value::string(m.tool_call_id));
  if (!m.name.empty()) d.m->set("name", jinja::value::string(m.name));
  return d;
}

}  // namespace

std::string chat_template::render_with(const std::vector<chat_message>& messages, const json::value* tools,
                                       bool add_generation_prompt, bool object_arguments,
                                       const jinja::environment& env) const {
  std::vector<jinja::value> msgs;
  for (auto& m : messages) msgs.push_back(message_value(m, object_arguments));
  jinja::value ctx = jinja::value::make_dict();
  ctx.m->set("messages", jinja::value::list(std::move(msgs)));
  ctx.m->set("tools", tools ? jinja::from_json(*tools) : jinja::value::none());
  ctx.m->set("documents", jinja::value::none());
  ctx.m->set("add_generation_prompt", jinja::value::boolean(add_generation_prompt));
  ctx.m->set("bos_token", jinja::value::string(bos_));
  ctx.m->set("eos_token", jinja::value::string(eos_));
  return tmpl_.render(ctx, env);
}

std::string chat_template::render(const std::vector<chat_message>& messages, const json::value* tools,
                                  bool add_generation_prompt, const jinja::environment& env) const {
  bool has_calls = false;
  for (auto& m : messages) has_calls = has_calls || !m.tool_calls.empty();
  if (!has_calls) return render_with(messages, tools, add_generation_prompt, true, env);
  try {
    return render_with(messages, tools, add_generation_prompt, true, env);
  } catch (const jinja::error& e) {
    // Some templates (functionary, DeepSeek R1 distills) concatenate the arguments as text.
    if (e.kind() != jinja::error_kind::render) throw;
    return render_with(messages, tools, add_generation_prompt, false, env);
  }
}

}  // namespace tandem
