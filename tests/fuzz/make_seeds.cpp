// Writes the seed corpus of every fuzz target (tests/fuzz/corpus/<target>/): real messages
// produced by the production encoders, so the fuzzers start past the framing.
//   make_seeds OUT_DIR
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <capnp/rpc-twoparty.h>
#include <kj/async-io.h>

#include "actors/common/wire.h"
#include "kernels/cpu/quant_ref.h"
#include "kernels/gguf/gguf.h"
#include "schemas/auth.capnp.h"
#include "transport/ucx/kv_auth.h"
#include "transport/ucx/kv_handshake.h"
#include "transport/ucx/kv_manifest.h"

namespace fs = std::filesystem;

namespace {

fs::path out_dir;

void put(const std::string& target, const std::string& name, const void* data, size_t n) {
  fs::create_directories(out_dir / target);
  std::ofstream(out_dir / target / name, std::ios::binary).write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
}
void put(const std::string& target, const std::string& name, const std::string& s) { put(target, name, s.data(), s.size()); }
void put(const std::string& target, const std::string& name, const std::vector<uint8_t>& v) { put(target, name, v.data(), v.size()); }

void http_seeds() {
  auto req = [](const std::string& m, const std::string& path, const std::string& body, bool key = true) {
    std::string r = m + " " + path + " HTTP/1.1\r\nHost: f\r\n";
    if (key) r += "Authorization: Bearer fuzz-key-0123456789\r\n";
    if (m == "POST") r += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
    return r + "\r\n" + body;
  };
  put("http", "get_health", req("GET", "/health", "", false));
  put("http", "get_models", req("GET", "/v1/models", ""));
  put("http", "no_key", req("GET", "/metrics", "", false));
  put("http", "completion", req("POST", "/v1/completions", R"({"prompt":"hi","max_tokens":4,"temperature":0.5,"top_p":0.9,"stop":["x"],"stream":false})"));
  put("http", "completion_stream", req("POST", "/v1/completions", R"({"prompt":[1,2,3],"max_tokens":2,"stream":true,"stream_options":{"include_usage":true}})"));
  put("http", "chat", req("POST", "/v1/chat/completions", R"({"messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"}]}],"max_completion_tokens":3})"));
  put("http", "chunked", "POST /v1/completions HTTP/1.1\r\nHost: f\r\nAuthorization: Bearer fuzz-key-0123456789\r\n"
                         "Transfer-Encoding: chunked\r\n\r\n10\r\n{\"prompt\":\"abc\"}\r\n0\r\n\r\n");
  put("http", "pipelined", req("GET", "/v1/models", "") + req("GET", "/health", "", false));
  put("http", "json_completion", std::string("J") + R"({"prompt":"a\u00e9\ud83d\ude00","max_tokens":1,"seed":7,"top_k":-1,"ignore_eos":true})");
  put("http", "json_chat", std::string("C") + R"({"messages":[{"role":"user","content":"x"},{"role":"assistant","content":"y"}],"n":1})");
  // Framing (transport/http/http_framing.h): what kj-http alone answered with a 500 and its stack.
  put("http", "framing_dup_length", std::string("POST /v1/completions HTTP/1.1\r\nHost: f\r\nAuthorization: Bearer fuzz-key-0123456789\r\nContent-Type: application/json\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}"));
  put("http", "framing_te_gzip", std::string("POST /v1/completions HTTP/1.1\r\nHost: f\r\nAuthorization: Bearer fuzz-key-0123456789\r\nTransfer-Encoding: gzip\r\n\r\n{}"));
  put("http", "framing_chunk_zzz", std::string("POST /v1/completions HTTP/1.1\r\nHost: f\r\nAuthorization: Bearer fuzz-key-0123456789\r\nTransfer-Encoding: chunked\r\n\r\nZZZ\r\n{}\r\n0\r\n\r\n"));
  put("http", "framing_cl_te", std::string("POST /v1/completions HTTP/1.1\r\nHost: f\r\nAuthorization: Bearer fuzz-key-0123456789\r\nContent-Length: 7\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"));
  put("http", "framing_version", std::string("GET /health HTTP/9.9\r\nHost: f\r\n\r\n"));
  put("http", "framing_close", std::string("GET /health HTTP/1.1\r\nHost: f\r\nConnection: close\r\n\r\nGET /health HTTP/1.1\r\nHost: f\r\n\r\n"));
  put("http", "framing_http10", std::string("GET /health HTTP/1.0\r\n\r\n"));
  put("http", "framer_pipelined", std::string("F\r\nPOST /a HTTP/1.1\r\nContent-Length: 5\r\n\r\nhelloPOST /b HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3;x=1\r\nabc\r\n0\r\nT: 1\r\n\r\nGET /c HTTP/1.1\r\nConnection: close\r\n\r\nGET /d HTTP/1.1\r\n\r\n"));
  put("http", "framer_bad_chunk", std::string("FPOST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\nabc\r\n0\r\n\r\n"));
  put("http", "framer_negative_length", std::string("FPOST / HTTP/1.1\r\nContent-Length: -5\r\n\r\n"));
  put("http", "json_numbers", std::string("J") + R"({"prompt":"a","max_tokens":1e2,"temperature":-0.0,"top_p":1E-3,"seed":18446744073709551615})");
}

/// The bytes a real client sends: bootstrap, Gate.authenticate(key), then a call on the result.
std::vector<uint8_t> rpc_client_bytes(const std::string& key, bool call_after) {
  auto io = kj::setupAsyncIo();
  auto pipe = kj::newTwoWayPipe();
  capnp::TwoPartyClient client(*pipe.ends[0]);
  auto req = client.bootstrap().castAs<tandem::auth::Gate>().authenticateRequest();
  req.setKey(key);
  auto p = req.send();
  kj::Promise<void> more = kj::READY_NOW;
  if (call_after) {
    // A pipelined call on the returned capability (authenticate again on it: any method will do).
    auto again = p.getCap().castAs<tandem::auth::Gate>().authenticateRequest();
    again.setKey(key);
    more = again.send().ignoreResult().catch_([](kj::Exception&&) {});
  }
  std::vector<uint8_t> out;
  kj::byte buf[4096];
  for (;;) {
    auto n = pipe.ends[1]->tryRead(buf, 1, sizeof buf)
                 .exclusiveJoin(io.provider->getTimer().afterDelay(100 * kj::MILLISECONDS).then([] { return size_t(0); }))
                 .wait(io.waitScope);
    if (n == 0) break;
    out.insert(out.end(), buf, buf + n);
  }
  return out;
}

void rpc_seeds() {
  put("rpc", "auth_ok", rpc_client_bytes("fuzz-key-0123456789", false));
  put("rpc", "auth_ok_then_call", rpc_client_bytes("fuzz-key-0123456789", true));
  put("rpc", "auth_wrong", rpc_client_bytes("wrong", true));
}

void wire_seeds() {
  using namespace tandem;
  // One seed per role (and a reply): the per-role unions of schemas/internal.capnp.
  put("wire", "submit", make_wire([](schema::Envelope::Builder e) {
        auto s = e.initPrefill().initSubmit();
        s.setId("cmpl-1");
        auto p = s.initPrompt(3);
        for (unsigned i = 0; i < 3; ++i) p.set(i, int32_t(i + 1));
        s.setMaxTokens(8);
        e.setVersion(schema::WIRE_VERSION);
      }).bytes);
  put("wire", "error", make_reply([](schema::Reply::Builder r) {
        auto er = r.initError();
        er.setKind(schema::ErrorKind::OVERLOADED);
        er.setMessage("busy");
      }).bytes);
  put("wire", "abort", make_wire([](schema::Envelope::Builder e) { e.initDecode().initAbort(); }).bytes);
  put("wire", "event", make_wire([](schema::Envelope::Builder e) { e.initRouter().initEvent(); }).bytes);
  put("wire", "forward", make_wire([](schema::Envelope::Builder e) { e.initWorker().initForward(); }).bytes);
  put("wire", "handoff", make_wire([](schema::Envelope::Builder e) { e.initDecode().initHandoff(); }).bytes);
  put("wire", "alloc", make_wire([](schema::Envelope::Builder e) { e.initCacheTier().initAlloc(); }).bytes);
}

void gguf_seeds() {
  tandem::gguf::writer w;
  w.set_string("general.architecture", "llama");
  w.set_u32("llama.block_count", 1);
  w.set_f32("llama.rope.freq_base", 10000.0f);
  w.set_bool("flag", true);
  w.set_array_string("tokenizer.ggml.tokens", {"<s>", "</s>", "a"});
  w.set_array_f32("tokenizer.ggml.scores", {0.0f, 0.0f, -1.0f});
  w.set_array_i32("tokenizer.ggml.token_type", {3, 3, 1});
  w.add_tensor("t.f32", tandem::ggml_type::f32, {4, 2}, std::vector<uint8_t>(32, 1));
  w.add_tensor("t.f16", tandem::ggml_type::f16, {8}, std::vector<uint8_t>(16, 2));
  put("gguf", "small", w.bytes());
  tandem::gguf::writer empty;
  put("gguf", "empty", empty.bytes());
  // One small tensor of every block type Tandem computes with, so the fuzzer starts with
  // valid blocks for each decoder.
  tandem::gguf::writer q;
  q.set_string("general.architecture", "llama");
  std::vector<float> ramp(512);
  for (size_t i = 0; i < ramp.size(); ++i) ramp[i] = float(int(i % 97) - 48) * 0.01f;
  for (auto t : {tandem::ggml_type::q4_0, tandem::ggml_type::q4_K, tandem::ggml_type::q5_K, tandem::ggml_type::q6_K})
    q.add_tensor("t." + std::string(tandem::to_string(t)), t, {256, 2}, tandem::cpu::quantize_rows(t, ramp.data(), 2, 256));
  std::vector<uint8_t> q8(2 * 8 * sizeof(tandem::block_q8_0), 3);
  q.add_tensor("t.q8_0", tandem::ggml_type::q8_0, {256, 2}, q8);
  put("gguf", "lowbit", q.bytes());
}

void kv_seeds() {
  using namespace tandem::ucx;
  kv_hello h;
  h.id.node = "peer";
  h.id.model = "r15m";
  h.id.layout.n_layers = 2;
  h.id.layout.n_kv_heads = 2;
  h.id.layout.head_dim = 8;
  h.id.layout.page_size = 16;
  h.pool_base = 0x7f0000000000;
  h.n_pages = 64;
  h.rkey = {1, 2, 3, 4};
  h.worker_address = {9, 9, 9};
  auto with_tag = [](uint8_t tag, std::vector<uint8_t> v) {
    v.insert(v.begin(), tag);
    return v;
  };
  put("kv", "hello", with_tag(0, encode_hello(h)));
  h.id.model = "other";
  h.id.layout.page_size = 32;
  put("kv", "hello_mismatch", with_tag(0, encode_hello(h)));
  put("kv", "descriptors", with_tag(1, encode_descriptors({7, {{0, 1, 2, 63}}})));
  put("kv", "descriptors_bad", with_tag(1, encode_descriptors({8, {{-1, 64}}})));
  put("kv", "challenge", with_tag(2, encode_challenge({"peer", std::vector<uint8_t>(kv_nonce_bytes, 5)})));
  put("kv", "proof", with_tag(3, encode_proof({std::vector<uint8_t>(kv_nonce_bytes, 6)})));
  put("kv", "proof_empty", with_tag(3, encode_proof({})));
  // A layout set of two pools (gemma2-like: a full and a sliding-window pool) with its region,
  // descriptors with a released window block, and a `done` carrying the per-pool manifest.
  h.id.model = "r15m";
  h.id.layout.page_size = 16;
  h.id.layout.n_layers = 1;
  h.id.pools = tandem::kv_pools_layout{
      .pools = {{.name = "full", .page = h.id.layout, .window_tokens = 0, .layers = {1}},
                {.name = "window", .page = h.id.layout, .window_tokens = 32, .layers = {0}}}};
  h.extra_pools = {{0x7f0000100000, 64, {5, 6, 7, 8}}};
  put("kv", "hello_pools", with_tag(0, encode_hello(h)));
  put("kv", "descriptors_pools", with_tag(1, encode_descriptors({9, {{0, 1, 2}, {-1, 3, 4}}})));
  put("kv", "notify_done", with_tag(4, encode_notify({9, notify_kind::done, {{3, 0x1234}, {2, 0x5678}}})));
  put("kv", "notify_cancel", with_tag(4, encode_notify({9, notify_kind::cancel, {}})));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds OUT_DIR\n");
    return 2;
  }
  out_dir = argv[1];
  http_seeds();
  rpc_seeds();
  wire_seeds();
  gguf_seeds();
  kv_seeds();
  return 0;
}
