// Tokenizers against llama.cpp's tokenizer tests (shared/vocab: vocabulary-only GGUF files
// with texts and the ids Hugging Face's tokenizers give them), special-token parsing, the
// pre-tokenizer table and `tandem tokenize`.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "kernels/gguf/gguf.h"
#include "kernels/tokenizer/pretokenizer.h"
#include "kernels/tokenizer/tokenizer.h"

using tandem::tokenizer;

namespace {

const std::filesystem::path k_vocab_dir = std::filesystem::path(TANDEM_SHARED_MODELS).parent_path() / "vocab";

std::string slurp(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  REQUIRE_MESSAGE(f.good(), "cannot read " << p.string());
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

struct vocab_case {
  std::string text;
  std::vector<int32_t> ids;
};

/// X.gguf.inp: texts each followed by "\n__ggml_vocab_test__\n"; X.gguf.out: one line of ids
/// per text (as llama.cpp's test-tokenizer-0 reads them).
std::vector<vocab_case> read_cases(const std::filesystem::path& gguf) {
  const std::string inp = slurp(gguf.string() + ".inp");
  const std::string out = slurp(gguf.string() + ".out");
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<vocab_case> cases;
  for (size_t p = 0, q; (q = inp.find(sep, p)) != std::string::npos; p = q + sep.size())
    cases.push_back({inp.substr(p, q - p), {}});
  std::istringstream lines(out);
  std::string line;
  size_t i = 0;
  for (; std::getline(lines, line); ++i) {
    REQUIRE_MESSAGE(i < cases.size(), gguf.string() << ".out has more lines than .inp has texts");
    std::istringstream ids(line);
    for (int32_t id; ids >> id;) cases[i].ids.push_back(id);
  }
  REQUIRE_MESSAGE(i == cases.size(), gguf.string() << ".out has " << i << " lines for " << cases.size() << " texts");
  return cases;
}

std::vector<std::filesystem::path> vocab_files() {
  std::vector<std::filesystem::path> v;
  for (const auto& e : std::filesystem::directory_iterator(k_vocab_dir))
    if (e.path().extension() == ".gguf") v.push_back(e.path());
  std::sort(v.begin(), v.end());
  return v;
}

std::unique_ptr<tokenizer> load(const std::string& name) {
  const auto f = tandem::gguf::file::open((k_vocab_dir / ("ggml-vocab-" + name + ".gguf")).string());
  return tokenizer::from_gguf(f);
}

std::string ids_str(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += (s.empty() ? "" : " ") + std::to_string(id);
  return s;
}

std::vector<int32_t> cat(std::initializer_list<std::vector<int32_t>> parts) {
  std::vector<int32_t> r;
  for (const auto& p : parts) r.insert(r.end(), p.begin(), p.end());
  return r;
}

bool contains(const std::vector<int32_t>& v, int32_t id) { return std::find(v.begin(), v.end(), id) != v.end(); }

}  // namespace

TEST_CASE("tokenizer vocab: every llama.cpp test case of every shared vocabulary gives the exact ids") {
  const auto files = vocab_files();
  // llama-spm, phi-3, gpt-2, deepseek-coder, deepseek-llm, falcon, mpt, refact, starcoder
  REQUIRE(files.size() >= 9);
  size_t total = 0;
  for (const auto& path : files) {
    const auto f = tandem::gguf::file::open(path.string());
    const auto tok = tokenizer::from_gguf(f);
    // Every shared vocabulary names a pre-tokenizer Tandem knows: no fallback warnings.
    CHECK_MESSAGE(tok->warnings().empty(), path.filename().string() << ": " << tok->warnings().front());
    const auto cases = read_cases(path);
    CHECK(cases.size() >= 40);
    size_t failed = 0;
    for (size_t i = 0; i < cases.size(); ++i) {
      const auto got = tok->encode(cases[i].text, false);
      if (got == cases[i].ids) continue;
      ++failed;
      FAIL_CHECK(path.filename().string() << " case " << i << " text [" << cases[i].text << "]\n  want "
                                          << ids_str(cases[i].ids) << "\n  got  " << ids_str(got));
    }
    MESSAGE(path.filename().string() << ": " << cases.size() - failed << "/" << cases.size() << " exact");
    total += cases.size();
  }
  CHECK(total >= 9 * 40);
}

TEST_CASE("tokenizer vocab: control tokens only with parse_special, user-defined tokens always") {
  SUBCASE("gpt-2 <|endoftext|>") {
    const auto tok = load("gpt-2");
    const int32_t eot = 50256;
    CHECK(tok->encode("<|endoftext|>", false, true) == std::vector<int32_t>{eot});
    const auto plain = tok->encode("<|endoftext|>", false);
    CHECK_FALSE(contains(plain, eot));
    CHECK(tok->decode(plain) == "<|endoftext|>");
    CHECK(tok->encode("Hi<|endoftext|> there", false, true) ==
          cat({tok->encode("Hi", false), {eot}, tok->encode(" there", false)}));
    CHECK(tok->encode("Hi<|endoftext|> there", false) == tok->encode("Hi<|endoftext|> there", false, false));
    CHECK(tok->token_text(eot) == "<|endoftext|>");
    CHECK(tok->token_bytes(eot).empty());
  }
  SUBCASE("llama-spm <s> and </s>: the text after a special token gets the dummy-prefix space") {
    const auto tok = load("llama-spm");
    CHECK(tok->encode("<s>Hello</s>", true, true) == cat({{1, 1}, tok->encode("Hello", false), {2}}));
    const auto plain = tok->encode("<s>Hello</s>", false);
    CHECK_FALSE(contains(plain, 1));
    CHECK_FALSE(contains(plain, 2));
    CHECK(tok->decode(plain) == "<s>Hello</s>");
  }
  SUBCASE("phi-3 chat markers") {
    const auto tok = load("phi-3");
    const auto ids = tok->encode("<|user|>\nHi<|end|>\n<|assistant|>", false, true);
    CHECK(ids.front() == 32010);
    CHECK(contains(ids, 32007));
    CHECK(ids.back() == 32001);
    const auto plain = tok->encode("<|user|>\nHi<|end|>\n<|assistant|>", false);
    CHECK_FALSE(contains(plain, 32010));
    CHECK_FALSE(contains(plain, 32007));
  }
  SUBCASE("mpt's user-defined runs of spaces match without parse_special (as in Hugging Face)") {
    const auto tok = load("mpt");
    const int32_t eight_spaces = 50270;
    REQUIRE(tok->piece(eight_spaces) == std::string(8, ' '));
    CHECK(tok->encode("x        y", false) == cat({tok->encode("x", false), {eight_spaces}, tok->encode("y", false)}));
  }
}

TEST_CASE("tokenizer vocab: an unknown pre-tokenizer falls back to 'default' with a warning naming both") {
  auto make = [](const char* pre) {
    tandem::gguf::writer w;
    w.set_string("tokenizer.ggml.model", "gpt2");
    w.set_string("tokenizer.ggml.pre", pre);
    w.set_array_string("tokenizer.ggml.tokens", {"a", "b", "ab", "c", "abc"});
    w.set_array_string("tokenizer.ggml.merges", {"a b"});
    const auto bytes = w.bytes();
    return tokenizer::from_gguf(tandem::gguf::file::parse(bytes));
  };
  const auto unknown = make("no-such-pre");
  CHECK(unknown->pre_name() == "default");
  REQUIRE(unknown->warnings().size() == 1);
  CHECK(unknown->warnings()[0].find("'no-such-pre'") != std::string::npos);
  CHECK(unknown->warnings()[0].find("'default'") != std::string::npos);
  CHECK(unknown->encode("ab", false) == std::vector<int32_t>{2});
  const auto known = make("llama-bpe");
  CHECK(known->pre_name() == "llama3");
  CHECK(known->warnings().empty());
  CHECK(known->encode("ab", false) == std::vector<int32_t>{2});
  // llama3 vocabularies ignore merges for a word that is a token ("abc" has no merge path)
  CHECK(known->encode("abc", false) == std::vector<int32_t>{4});
  CHECK(make("gpt-2")->encode("abc", false) == std::vector<int32_t>{2, 3});
}

TEST_CASE("tokenizer vocab: every pre-tokenizer compiles and splits without losing a byte") {
  const std::string text =
      "Hello World's 12345 \xF0\x9F\xA6\x99 caf\xC3\xA9\n\n  \t x=1;\xE4\xBD\xA0\xE5\xA5\xBD\xE3\x80\x82 IMGIMGABZ "
      "<sentinel:3> \xFF\xFE bad bytes  \r\n";
  CHECK(tandem::all_pre_specs().size() >= 15);
  for (const auto& spec : tandem::all_pre_specs()) {
    CAPTURE(spec.name);
    const tandem::regex_splitter sp(spec.regexes);
    std::string back;
    for (auto piece : sp.split(text)) {
      CHECK_FALSE(piece.empty());
      back += piece;
    }
    CHECK(back == text);
  }
}

TEST_CASE("tokenizer vocab: regex splitting keeps the text between matches and splits at empty matches") {
  auto split = [](const std::vector<std::string>& re, std::string_view s) {
    const tandem::regex_splitter sp(re);
    std::vector<std::string> out;
    for (auto p : sp.split(s)) out.emplace_back(p);
    return out;
  };
  // superbpe's digit grouping: only empty matches (lookaheads), which mark split points
  CHECK(split({R"((?=(\d{3})+(?!\d)))"}, "1234567") == std::vector<std::string>{"1", "234", "567"});
  // unmatched text stays as its own piece; the second regex splits the first one's pieces
  CHECK(split({"[0-9]+", "[a-z]"}, "ab12-c") == std::vector<std::string>{"a", "b", "12", "-", "c"});
  // a lookahead cannot see past the piece it runs on
  CHECK(split({"x", R"(\s+(?!\S))"}, "  x") == std::vector<std::string>{"  ", "x"});
  // deepseek-llm's \s+$: whitespace at the end of the piece only
  CHECK(split({R"(\s+$)"}, "a \nb \n") == std::vector<std::string>{"a \nb", " \n"});
}

TEST_CASE("tokenizer vocab: one tokenizer encodes from several threads at once") {
  const auto tok = load("deepseek-llm");
  const auto cases = read_cases(k_vocab_dir / "ggml-vocab-deepseek-llm.gguf");
  std::vector<std::thread> threads;
  std::array<int, 4> bad{};
  for (size_t t = 0; t < bad.size(); ++t)
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 3; ++rep)
        for (const auto& c : cases)
          if (tok->encode(c.text, false) != c.ids) ++bad[t];
    });
  for (auto& th : threads) th.join();
  CHECK(bad == std::array<int, 4>{});
}

namespace {

std::pair<int, std::string> run_tokenize(const std::string& args, const std::string& stdin_text) {
  const auto in = std::filesystem::temp_directory_path() / ("tandem-tokenize-" + std::to_string(::getpid()) + ".txt");
  {
    std::ofstream f(in, std::ios::binary);
    f << stdin_text;
  }
  const std::string cmd = std::string(TANDEM_BINARY) + " tokenize " + args + " < " + in.string() + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  std::array<char, 4096> buf{};
  for (size_t n; (n = fread(buf.data(), 1, buf.size(), p)) > 0;) out.append(buf.data(), n);
  const int st = pclose(p);
  std::filesystem::remove(in);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

}  // namespace

TEST_CASE("tokenizer vocab: tandem tokenize prints the ids of stdin, with --no-bos, --special and --pieces") {
  const std::string model = (k_vocab_dir / "ggml-vocab-llama-spm.gguf").string();
  // llama.cpp's case "Hello world" of llama-spm: 15043 3186; BOS 1 unless --no-bos
  auto [rc, out] = run_tokenize("--model " + model, "Hello world");
  CHECK(rc == 0);
  CHECK(out == "1 15043 3186\n");
  std::tie(rc, out) = run_tokenize("--model " + model + " --no-bos", "Hello world");
  CHECK(out == "15043 3186\n");
  std::tie(rc, out) = run_tokenize("--model " + model + " --no-bos --special", "</s>");
  CHECK(out == "2\n");
  std::tie(rc, out) = run_tokenize("--model " + model + " --no-bos --pieces", "Hello world\n");
  CHECK(rc == 0);
  CHECK(out == "15043\t Hello\n3186\t world\n13\t\\x0A\n");
  std::tie(rc, out) = run_tokenize("", "x");
  CHECK(rc == 1);
  CHECK(out.find("missing --model FILE") != std::string::npos);
}
