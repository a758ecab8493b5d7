#include "transport/chat/chat_prompt.h"

#include <functional>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "kernels/base/error.h"
#include "kernels/tokenizer/tokenizer.h"
#include "kernels/base/json.h"

namespace tandem {

namespace {

[[noreturn]] void wrong(std::string_view name, std::string_view want, const json::value& v) {
  throw chat_input_error{fmt::format("'{}' must be {}, got {}", name, want, json::kind_name(v.k)), std::string(name),
                         "invalid_type"};
}

const json::value* present(const json::value& o, std::string_view k) {
  auto* v = o.find(k);
  return (v && v->k == json::kind::null) ? nullptr : v;
}

std::string optional_string(const json::value& o, std::string_view k, std::string_view where) {
  auto* v = present(o, k);
  if (!v) return {};
  if (v->k != json::kind::string) wrong(fmt::format("{}.{}", where, k), "a string", *v);
  return v->s;
}

chat_tool_call parse_tool_call(const json::value& c) {
  if (c.k != json::kind::object) wrong("messages[].tool_calls[]", "an object", c);
  chat_tool_call tc;
  tc.id = optional_string(c, "id", "messages[].tool_calls[]");
  const std::string type = optional_string(c, "type", "messages[].tool_calls[]");
  if (!type.empty() && type != "function")
    throw chat_input_error{fmt::format("tool_calls[].type \"{}\" is not supported; use \"function\"", type), "messages",
                           "invalid_type"};
  auto* fn = present(c, "function");
  if (!fn || fn->k != json::kind::object)
    throw chat_input_error{"each tool call needs a 'function' object with 'name' and 'arguments'", "messages", "invalid_type"};
  tc.name = optional_string(*fn, "name", "messages[].tool_calls[].function");
  if (tc.name.empty()) throw chat_input_error{"tool_calls[].function.name is required", "messages", "missing_field"};
  if (auto* a = present(*fn, "arguments")) {
    if (a->k == json::kind::string) {
      tc.arguments = a->s;
    } else if (a->k != json::kind::object) {
      wrong("messages[].tool_calls[].function.arguments", "a JSON string (or an object)", *a);
    } else {
      // Clients that send an object: keep its members in order as JSON text.
      json::writer w;
      std::function<void(const json::value&)> put = [&](const json::value& v) {
        switch (v.k) {
          case json::kind::null: w.null(); break;
          case json::kind::boolean: w.boolean(v.b); break;
          case json::kind::number:
            if (v.is_int) w.num(v.i);
            else w.real(v.num);
            break;
          case json::kind::string: w.str(v.s); break;
          case json::kind::array:
            w.begin_array();
            for (auto& x : v.arr) put(x);
            w.end_array();
            break;
          case json::kind::object:
            w.begin_object();
            for (auto& m : v.obj) {
              w.key(m.first);
              put(m.second);
            }
            w.end_object();
            break;
        }
      };
      put(*a);
      tc.arguments = w.take();
    }
  } else {
    tc.arguments = "{}";
  }
  return tc;
}

}  // namespace

chat_request parse_chat_request(const json::value& body) {
  chat_request req;
  auto* m = present(body, "messages");
  if (!m) throw chat_input_error{"'messages' is required", "messages", "missing_field"};
  if (m->k != json::kind::array)
    throw chat_input_error{fmt::format("'messages' must be an array, got {}", json::kind_name(m->k)), "messages", "invalid_type"};
  for (auto& e : m->arr) {
    if (e.k != json::kind::object) wrong("messages[]", "an object", e);
    auto* role = present(e, "role");
    if (!role || role->k != json::kind::string) throw chat_input_error{"each message needs a string 'role'", "messages", "invalid_type"};
    chat_message cm(role->s, "");
    if (auto* c = present(e, "content")) {
      if (c->k == json::kind::string) {
        cm.content = c->s;
      } else if (c->k == json::kind::array) {
        for (auto& part : c->arr) {
          auto* t = part.k == json::kind::object ? present(part, "text") : nullptr;
          auto* ty = part.k == json::kind::object ? present(part, "type") : nullptr;
          if (!t || t->k != json::kind::string || (ty && (ty->k != json::kind::string || ty->s != "text")))
            throw chat_input_error{"message content parts must be {\"type\":\"text\",\"text\":...}", "messages", "invalid_type"};
          cm.content += t->s;
        }
      } else {
        wrong("messages[].content", "a string or an array of text parts", *c);
      }
    } else {
      cm.content_null = true;
    }
    if (auto* tcs = present(e, "tool_calls")) {
      if (tcs->k != json::kind::array) wrong("messages[].tool_calls", "an array", *tcs);
      for (auto& c : tcs->arr) cm.tool_calls.push_back(parse_tool_call(c));
    }
    cm.tool_call_id = optional_string(e, "tool_call_id", "messages[]");
    cm.name = optional_string(e, "name", "messages[]");
    req.messages.push_back(std::move(cm));
  }
  if (auto* t = present(body, "tools")) {
    if (t->k != json::kind::array) throw chat_input_error{fmt::format("'tools' must be an array, got {}", json::kind_name(t->k)), "tools", "invalid_type"};
    req.tools = t;
  }
  return req;
}

std::vector<int32_t> render_chat_llama2(const tokenizer& tok, const std::vector<chat_message>& messages) {
  std::string system;
  struct turn {
    std::string user, assistant;
    bool has_assistant = false;
  };
  std::vector<turn> turns;
  auto join = [](std::string& into, const std::string& s) {
    if (!into.empty()) into += "\n\n";
    into += s;
  };
  for (auto& m : messages) {
    if (m.role == "tool" || !m.tool_calls.empty())
      throw error(error_kind::failed,
                  "messages: tool calls and role \"tool\" need a chat template, and this model has none "
                  "(no tokenizer.chat_template; the Llama-2 fallback has no tool role): serve it with "
                  "--chat-template-file");
    if (m.role == "system" || m.role == "developer") {
      join(system, m.content);
    } else if (m.role == "user") {
      if (turns.empty() || turns.back().has_assistant) turns.emplace_back();
      join(turns.back().user, m.content);
    } else if (m.role == "assistant") {
      if (turns.empty()) turns.emplace_back();  // assistant speaks first: empty user turn
      join(turns.back().assistant, m.content);
      turns.back().has_assistant = true;
    } else {
      throw error(error_kind::failed,
                  fmt::format("messages: role \"{}\" is not supported; use system, developer, user, assistant or tool", m.role));
    }
  }
  if (turns.empty() && system.empty()) throw error(error_kind::failed, "messages is empty; send at least one message");
  // The model answers an open user turn; end with one even if the last message was the assistant's.
  if (turns.empty() || turns.back().has_assistant) turns.emplace_back();
  std::vector<int32_t> ids;
  for (size_t i = 0; i < turns.size(); ++i) {
    std::string text = "[INST] ";
    if (i == 0 && !system.empty()) text += "<<SYS>>\n" + system + "\n<</SYS>>\n\n";
    text += turns[i].user + " [/INST]";
    if (turns[i].has_assistant) text += " " + turns[i].assistant + " ";
    auto seg = tok.encode(text, true);
    ids.insert(ids.end(), seg.begin(), seg.end());
    if (turns[i].has_assistant && tok.eos_id() >= 0) ids.push_back(tok.eos_id());
  }
  return ids;
}

chat_prompter::chat_prompter(const tokenizer& tok, const std::string& override_source, jinja::environment env)
    : tok_(tok), env_(std::move(env)), source_("llama2-fallback") {
  const std::string bos = tok.bos_id() >= 0 ? tok.token_text(tok.bos_id()) : "";
  const std::string eos = tok.eos_id() >= 0 ? tok.token_text(tok.eos_id()) : "";
  if (!override_source.empty()) {
    try {
      tmpl_ = std::make_unique<chat_template>(override_source, bos, eos);
    } catch (const jinja::error& e) {
      throw error(error_kind::failed, fmt::format("--chat-template-file: {}; fix the template", e.what()));
    }
    source_ = "override";
  } else if (!tok.chat_template().empty()) {
    try {
      tmpl_ = std::make_unique<chat_template>(tok.chat_template(), bos, eos);
      source_ = "model";
    } catch (const jinja::error& e) {
      spdlog::warn("the model's tokenizer.chat_template does not parse ({}); chat uses the Llama-2 fallback instead "
                   "(pass --chat-template-file to give a template)",
                   e.what());
    }
  }
}

std::string chat_prompter::text(const chat_request& req) const {
  if (!tmpl_) return {};
  try {
    return tmpl_->render(req.messages, req.tools, true, env_);
  } catch (const jinja::error& e) {
    throw error(error_kind::failed,
                fmt::format("messages: the chat template ({}) could not render this conversation: {}", source_, e.what()));
  }
}

std::vector<int32_t> chat_prompter::prompt(const chat_request& req) const {
  if (req.messages.empty()) throw error(error_kind::failed, "messages is empty; send at least one message");
  for (auto& m : req.messages)
    if (m.role != "system" && m.role != "developer" && m.role != "user" && m.role != "assistant" && m.role != "tool")
      throw error(error_kind::failed,
                  fmt::format("messages: role \"{}\" is not supported; use system, developer, user, assistant or tool", m.role));
  if (!tmpl_) {
    if (req.tools && !req.tools->arr.empty())
      throw error(error_kind::failed,
                  "tools: this model has no chat template (tokenizer.chat_template) to show tools to it, and the "
                  "Llama-2 fallback has none: serve it with --chat-template-file");
    return render_chat_llama2(tok_, req.messages);
  }
  auto ids = tok_.encode(text(req), true, true);
  // The template wrote the BOS text (parsed as BOS) and the vocabulary added one too.
  if (ids.size() >= 2 && tok_.bos_id() >= 0 && ids[0] == tok_.bos_id() && ids[1] == tok_.bos_id()) ids.erase(ids.begin());
  return ids;
}

}  // namespace tandem
