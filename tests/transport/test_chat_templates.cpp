// The 17 real chat templates of shared/chat-templates rendered by our Jinja interpreter and by
// jinja2 (tests/transport/chat/render_ref.py, Hugging Face's settings) on the conversations
// of tests/transport/chat/cases.json: the texts must be byte-identical, and a conversation a
// template refuses (raise_exception, a type error) must fail in both.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include <doctest/doctest.h>
#include <fmt/format.h>

#include "transport/chat/chat_template.h"
#include "transport/chat/jinja.h"
#include "transport/http/json.h"

using namespace tandem;

namespace {

const std::filesystem::path k_templates_dir = std::filesystem::path(TANDEM_SHARED_MODELS).parent_path() / "chat-templates";
const std::filesystem::path k_chat_dir = std::filesystem::path(TANDEM_SOURCE_DIR) / "tests" / "transport" / "chat";
/// 2024-07-26 12:00:00 UTC, the instant render_ref.py's strftime_now formats.
constexpr std::time_t k_fixed_now = 1721995200;

std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string run(const std::string& cmd) {
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE_MESSAGE(p, "cannot run: ", cmd);
  std::string out;
  char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int rc = pclose(p);
  REQUIRE_MESSAGE(rc == 0, "the reference renderer failed (needs python3 and python3-jinja2; deploy/install-deps.sh): ", cmd);
  return out;
}

/// Where two texts first differ, with some context, for the failure message.
std::string first_difference(const std::string& a, const std::string& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  const size_t from = i > 40 ? i - 40 : 0;
  return fmt::format("byte {}: ours ...{}... jinja2 ...{}...", i, json::quote(a.substr(from, 100)), json::quote(b.substr(from, 100)));
}

}  // namespace

TEST_CASE("chat templates: each of the 17 shared templates renders byte-identically to python3-jinja2 on every conversation") {
  std::vector<std::filesystem::path> templates;
  for (auto& e : std::filesystem::directory_iterator(k_templates_dir))
    if (e.path().extension() == ".jinja") templates.push_back(e.path());
  std::sort(templates.begin(), templates.end());
  REQUIRE(templates.size() == 17);

  const auto cases_path = k_chat_dir / "cases.json";
  std::string cmd = fmt::format("python3 '{}' '{}'", (k_chat_dir / "render_ref.py").string(), cases_path.string());
  for (auto& t : templates) cmd += fmt::format(" '{}'", t.string());
  const json::value ref = json::parse(run(cmd), 512);
  const json::value spec = json::parse(read_file(cases_path), 512);

  jinja::environment env;
  env.now = [] { return k_fixed_now; };
  size_t texts = 0, errors = 0, templates_ok = 0;
  for (auto& path : templates) {
    const json::value* expected = ref.find(path.string());
    REQUIRE(expected);
    std::optional<jinja::template_> tmpl;
    std::string parse_error;
    try {
      tmpl.emplace(read_file(path));
    } catch (const jinja::error& e) {
      parse_error = e.what();
    }
    bool all_ok = true;
    for (auto& c : spec.find("cases")->arr) {
      const std::string name = c.find("name")->s;
      CAPTURE(path.filename().string());
      CAPTURE(name);
      jinja::value ctx = jinja::value::make_dict();
      ctx.m->set("messages", jinja::from_json(*c.find("messages")));
      ctx.m->set("tools", c.find("tools") ? jinja::from_json(*c.find("tools")) : jinja::value::none());
      ctx.m->set("documents", jinja::value::none());
      ctx.m->set("add_generation_prompt", jinja::value::boolean(c.find("add_generation_prompt")->b));
      ctx.m->set("bos_token", jinja::value::string(spec.find("bos_token")->s));
      ctx.m->set("eos_token", jinja::value::string(spec.find("eos_token")->s));
      for (auto& m : spec.find("extra")->obj) ctx.m->set(m.first, jinja::from_json(m.second));
      std::string ours, our_error = parse_error;
      if (tmpl) {
        try {
          ours = tmpl->render(ctx, env);
        } catch (const jinja::error& e) {
          our_error = e.what();
        }
      }
      const json::value* r = expected->find(name);
      REQUIRE(r);
      if (const json::value* text = r->find("text")) {
        CHECK_MESSAGE(our_error.empty(), "jinja2 rendered it; we failed: ", our_error);
        const bool same = ours == text->s;
        CHECK_MESSAGE(same, first_difference(ours, text->s));
        const bool ok = our_error.empty() && same;
        texts += ok;
        all_ok = all_ok && ok;
      } else {
        CHECK_MESSAGE(!our_error.empty(), "jinja2 failed (", r->find("error")->s, "); we rendered: ", json::quote(ours));
        errors += !our_error.empty();
        all_ok = all_ok && !our_error.empty();
      }
    }
    templates_ok += all_ok;
  }
  MESSAGE(fmt::format("{} of {} templates match jinja2 on every conversation ({} identical texts, {} refusals in both)",
                      templates_ok, templates.size(), texts, errors));
  CHECK(templates_ok == templates.size());
}

TEST_CASE("chat templates: tool-call arguments reach a template as an object, or as text when it concatenates them") {
  chat_message call("assistant", "");
  call.content_null = true;
  call.tool_calls.push_back({"abc123def", "get_weather", R"({"city": "Paris"})"});
  chat_message result("tool", "21");
  result.tool_call_id = "abc123def";
  const std::vector<chat_message> msgs{{"user", "Weather?"}, call, result};
  jinja::environment env;
  env.now = [] { return k_fixed_now; };

  // Llama 3.1 writes `arguments | tojson`: the object's JSON, not a quoted string.
  chat_template llama(read_file(k_templates_dir / "meta-llama-Llama-3.1-8B-Instruct.jinja"), "<|begin_of_text|>", "<|eot_id|>");
  const auto l = llama.render(msgs, nullptr, true, env);
  CHECK(l.find(R"({"name": "get_weather", "parameters": {"city": "Paris"}})") != std::string::npos);
  CHECK(l.find("Today Date: 26 Jul 2024") != std::string::npos);

  // functionary v3.1 concatenates `arguments` to a string: the object fails, the text renders.
  chat_template fn(read_file(k_templates_dir / "meetkai-functionary-medium-v3.1.jinja"), "<s>", "</s>");
  const auto f = fn.render(msgs, nullptr, true, env);
  CHECK(f.find(R"(<function=get_weather>{"city": "Paris"}</function>)") != std::string::npos);

  // A refusal keeps its kind.
  chat_template gemma(read_file(k_templates_dir / "google-gemma-2-2b-it.jinja"), "<s>", "</s>");
  try {
    gemma.render({{"system", "x"}, {"user", "y"}}, nullptr, true, env);
    FAIL("gemma renders a system message");
  } catch (const jinja::error& e) {
    CHECK(e.kind() == jinja::error_kind::raised);
    CHECK(std::string(e.what()).find("System role not supported") != std::string::npos);
  }
}
