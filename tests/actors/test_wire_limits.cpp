// The traversal budget of actor messages is scaled to their size (wire_limits, docs/security.md):
// the fuzzer's 64-byte input (48 bytes before the per-role framing) that declares millions of
// zero-sized list elements is refused at its first read, and the largest messages the runtime
// really sends still decode in full.
#include <doctest/doctest.h>

#include <capnp/dynamic.h>
#include <capnp/schema.h>

#include <fstream>
#include <iterator>
#include <numeric>
#include <string>
#include <vector>

#include "actors/common/wire.h"

using namespace tandem;

namespace {

/// The kj exception text of `f()`, or "" if it did not throw.
template <class F>
std::string kj_error_of(F&& f) {
  try {
    f();
  } catch (const kj::Exception& e) {
    return e.getDescription().cStr();
  }
  return "";
}

/// Reads every field reachable from `v` (every pointer once, as a careful reader does) and
/// returns the number of list elements and text bytes seen.
uint64_t walk(capnp::DynamicValue::Reader v) {
  uint64_t n = 0;
  switch (v.getType()) {
    case capnp::DynamicValue::STRUCT: {
      auto s = v.as<capnp::DynamicStruct>();
      KJ_IF_MAYBE(f, s.which()) { n += walk(s.get(*f)); }
      for (auto f : s.getSchema().getNonUnionFields())
        if (s.has(f)) n += walk(s.get(f));
      break;
    }
    case capnp::DynamicValue::LIST:
      for (auto e : v.as<capnp::DynamicList>()) n += 1 + walk(e);
      break;
    case capnp::DynamicValue::TEXT: n += v.as<capnp::Text>().size(); break;
    default: break;
  }
  return n;
}

std::vector<int32_t> iota(size_t n, int32_t from = 0) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), from);
  return v;
}

}  // namespace

TEST_CASE("wire limits: the traversal budget is a multiple of the message size, capped") {
  wire_limits lim;
  CHECK(lim.traversal_budget(6) == 6 * lim.traversal_words_per_word + lim.traversal_slack_words);
  CHECK(lim.traversal_budget(0) == lim.traversal_slack_words);
  CHECK(lim.traversal_budget(lim.traversal_limit_words) == lim.traversal_limit_words);
  CHECK(lim.traversal_budget(UINT64_MAX / 2) == lim.traversal_limit_words);  // no overflow
  lim.traversal_words_per_word = 0;
  CHECK(lim.traversal_budget(1 << 20) == lim.traversal_slack_words);
}

TEST_CASE("wire limits: the 64-byte input declaring millions of zero-sized elements is refused at its first read") {
  std::ifstream in(TANDEM_SOURCE_DIR "/tests/fuzz/corpus/wire/regress-zero-size-list-8m-elements", std::ios::binary);
  REQUIRE(in);
  wire w{std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {})};
  REQUIRE(w.bytes.size() == 64);  // 48 bytes before the per-role framing (Envelope.worker)
  {
    wire_reader rd(w);
    auto env = rd.root();
    REQUIRE(env.isWorker());
    REQUIRE(env.getWorker().isForward());
    const std::string why = kj_error_of([&] { (void)env.getWorker().getForward().getSeqs().size(); });
    INFO("error: " << why);
    CHECK(why.find("traversal limit") != std::string::npos);
  }
  {
    // What the scaling closes: under the fixed 2^23-word budget the same bytes hand a reader
    // (the worker sizes its per-sequence vectors by this list) millions of elements.
    wire_limits fixed;
    fixed.traversal_words_per_word = fixed.traversal_limit_words;
    wire_reader rd(w, fixed);
    uint32_t n = 0;
    CHECK(kj_error_of([&] { n = rd.root().getWorker().getForward().getSeqs().size(); }).empty());
    CHECK(n > (1u << 20));
  }
}

TEST_CASE("wire limits: the largest real messages decode in full under the scaled budget") {
  // Sizes at the top of what the runtime sends: a decode step of 256 sequences with 8192-token
  // page tables, a prefill batch of 8 chunks of 256 tokens at a 128K context, KV descriptors of
  // 8192 pages, a 128K-token prompt, a cache copy of 1024 pages and a stats reply.
  const int32_t pages_per_seq = 8192, ctx = 131072;
  std::vector<wire> msgs;
  msgs.push_back(make_wire([&](schema::Envelope::Builder root) {
    auto env = root.initWorker();
    auto seqs = env.initForward().initSeqs(256);
    env.getForward().setPhase(schema::StageRole::DECODE);
    for (unsigned i = 0; i < seqs.size(); ++i) {
      seqs[i].setId("request-" + std::to_string(i));
      fill_list([&](unsigned n) { return seqs[i].initTokens(n); }, std::vector<int32_t>{int32_t(i)});
      seqs[i].setPos(ctx - 1);
      fill_list([&](unsigned n) { return seqs[i].initPages(n); }, iota(size_t(pages_per_seq)));
      seqs[i].setSample(true);
      seqs[i].initSampling().setSeed(i);
    }
  }));
  msgs.push_back(make_wire([&](schema::Envelope::Builder root) {
    auto env = root.initWorker();
    auto seqs = env.initForward().initSeqs(8);
    env.getForward().setPhase(schema::StageRole::PREFILL);
    for (unsigned i = 0; i < seqs.size(); ++i) {
      seqs[i].setId("request-" + std::to_string(i));
      fill_list([&](unsigned n) { return seqs[i].initTokens(n); }, iota(256));
      seqs[i].setPos(ctx - 256);
      fill_list([&](unsigned n) { return seqs[i].initPages(n); }, iota(size_t(pages_per_seq)));
    }
  }));
  msgs.push_back(make_wire([&](schema::Envelope::Builder root) {
    auto env = root.initDecode();
    auto h = env.initHandoff();
    auto r = h.initRequest();
    r.setId("request-1");
    fill_list([&](unsigned n) { return r.initPrompt(n); }, iota(size_t(ctx)));
    fill_list([&](unsigned n) { return r.initGenerated(n); }, std::vector<int32_t>{5});
    auto kv = h.initKv();
    kv.setPoolId("node-a/worker");
    kv.setNode("node-a");
    fill_list([&](unsigned n) { return kv.initPageIds(n); }, iota(size_t(pages_per_seq)));
    kv.setValidTokens(ctx);
    h.setTransferId(7);
  }));
  msgs.push_back(make_wire([&](schema::Envelope::Builder root) {
    auto env = root.initWorker();
    auto o = env.initKvSend();
    o.setId("request-1");
    o.setPeerNode("node-b");
    fill_list([&](unsigned n) { return o.initPages(n); }, iota(size_t(pages_per_seq)));
  }));
  msgs.push_back(make_wire([&](schema::Envelope::Builder root) {
    auto env = root.initCacheTier();
    auto ins = env.initInsert();
    ins.setId("request-1");
    fill_list([&](unsigned n) { return ins.initTokens(n); }, iota(size_t(ctx)));
    fill_list([&](unsigned n) { return ins.initPages(n); }, iota(size_t(pages_per_seq)));
  }));
  msgs.push_back(make_wire([&](schema::Envelope::Builder root) {
    auto env = root.initWorker();
    auto ops = env.initCacheCopy().initOps(1024);
    env.getCacheCopy().setId("backup");
    for (unsigned i = 0; i < ops.size(); ++i) {
      ops[i].setDevice(int32_t(i));
      ops[i].setHash(i * 7919u);
      fill_list([&](unsigned n) { return ops[i].initTokens(n); }, iota(16, int32_t(i)));
    }
  }));
  msgs.push_back(make_wire([&](schema::Envelope::Builder root) {
    auto env = root.initReply();
    auto r = env.initStatsReply();
    r.setActor("router");
    auto ms = r.initMetrics(512);
    for (unsigned i = 0; i < ms.size(); ++i) {
      ms[i].setName("metric_" + std::to_string(i));
      ms[i].setLabels("reason=\"queue_requests\"");
      ms[i].setKind("counter");
      ms[i].setHelp("a help text of about the usual length for one metric");
    }
    auto hs = r.initHistograms(64);
    for (unsigned i = 0; i < hs.size(); ++i) {
      hs[i].setName("histogram_" + std::to_string(i));
      auto b = hs[i].initBounds(15);
      for (unsigned k = 0; k < b.size(); ++k) b.set(k, double(k));
      hs[i].initCounts(16);
    }
  }));
  // Tiny messages too: the budget's slack covers a reader's repeated small getters.
  msgs.push_back(make_wire([&](schema::Envelope::Builder root) {
    auto env = root.initDecode();
    env.initAbort().setId("r");
  }));

  for (size_t m = 0; m < msgs.size(); ++m) {
    INFO("message " << m << ", " << msgs[m].bytes.size() << " bytes");
    {
      // Every field, every element: a careful reader's full traversal fits the budget.
      wire_reader rd(msgs[m]);
      uint64_t seen = 0;
      const std::string why = kj_error_of([&] { seen = walk(capnp::DynamicStruct::Reader(rd.root())); });
      CHECK(why == "");
      CHECK(seen > 0);
    }
    {
      // And twice more on one reader (actors re-read fields of a message they hold).
      wire_reader rd(msgs[m]);
      const std::string why = kj_error_of([&] {
        for (int k = 0; k < 3; ++k) (void)walk(capnp::DynamicStruct::Reader(rd.root()));
      });
      CHECK(why == "");
    }
  }
  // The typed reads the worker does on the decode step (wire_reader with the default limits).
  wire_reader rd(msgs[0]);
  auto seqs = rd.root().getWorker().getForward().getSeqs();
  REQUIRE(seqs.size() == 256);
  size_t pages = 0, tokens = 0;
  for (auto s : seqs) {
    pages += to_vector(s.getPages()).size();
    tokens += to_vector(s.getTokens()).size();
  }
  CHECK(pages == size_t(256) * pages_per_seq);
  CHECK(tokens == 256);
}
