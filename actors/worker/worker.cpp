#include "actors/worker/worker.h"

#include <fmt/format.h>

#include <caf/all.hpp>
#include <chrono>

#include "actors/common/metrics.h"
#include "actors/common/wire.h"
#include "kernels/model/sampler.h"

namespace tandem {

uint64_t token_seed(uint64_t request_seed, int32_t token_index) {
  // splitmix64 of (seed, index): well mixed, stable across nodes and builds.
  uint64_t z = request_seed ^ (0x9E3779B97F4A7C15ull * (static_cast<uint64_t>(token_index) + 1));
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

namespace {

struct worker_state {
  std::shared_ptr<llama_model> model;
  std::unique_ptr<kv_pool> pool;
  std::shared_ptr<mailbox_gate> gate;
  std::shared_ptr<spdlog::logger> log;
  worker_options opt;
  std::vector<float> logits;
  int64_t batches = 0, tokens = 0, failures = 0;
  histogram forward_ms{"worker_forward_ms", "Worker forward pass time (ms)", histogram::latency_ms_buckets()};
  static inline const char* name = "worker";
};

wire fail_result(const tandem::error& e) {
  return make_wire([&](schema::Envelope::Builder env) {
    auto r = env.initForwardResult();
    r.setFailed(true);
    set_error(r.initError(), e);
  });
}

wire run_forward(worker_state& st, const wire& w) {
  wire_reader rd(w);
  auto env = rd.root();
  if (!env.isForward())
    return fail_result(tandem::error(error_kind::unimplemented, "worker: expected a forward batch message"));
  auto fb = env.getForward();
  auto seqs = fb.getSeqs();
  const int32_t n_vocab = st.model->config().n_vocab;
  const int32_t ps = st.opt.page_size;
  // Copy the spans' storage out of the message and validate every index before computing.
  std::vector<std::vector<int32_t>> toks(seqs.size()), pages(seqs.size());
  std::vector<batch_seq> batch(seqs.size());
  int64_t n_tok = 0;
  for (unsigned i = 0; i < seqs.size(); ++i) {
    auto s = seqs[i];
    toks[i] = to_vector(s.getTokens());
    pages[i] = to_vector(s.getPages());
    for (auto t : toks[i])
      if (t < 0 || t >= n_vocab)
        return fail_result(tandem::error(
            error_kind::failed, fmt::format("request {}: token id {} is outside the vocabulary [0, {})",
                                            s.getId().cStr(), t, n_vocab)));
    for (auto p : pages[i])
      if (p < 0 || p >= st.pool->n_pages())
        return fail_result(tandem::error(error_kind::failed,
                                         fmt::format("request {}: page id {} outside the pool of {} pages",
                                                     s.getId().cStr(), p, st.pool->n_pages())));
    const int64_t need = (int64_t(s.getPos()) + int64_t(toks[i].size()) + ps - 1) / ps;
    if (toks[i].empty() || s.getPos() < 0 || int64_t(pages[i].size()) < need)
      return fail_result(tandem::error(
          error_kind::failed, fmt::format("request {}: bad forward step (pos {}, {} tokens, {} pages)",
                                          s.getId().cStr(), s.getPos(), toks[i].size(), pages[i].size())));
    batch[i].tokens = toks[i];
    batch[i].pos = s.getPos();
    batch[i].pages = pages[i];
    batch[i].want_logits = s.getSample();
    n_tok += int64_t(toks[i].size());
  }
  auto t0 = std::chrono::steady_clock::now();
  st.model->forward(batch, *st.pool, st.logits);
  std::vector<int32_t> out(seqs.size(), -1);
  size_t row = 0;
  for (unsigned i = 0; i < seqs.size(); ++i) {
    if (!batch[i].want_logits) continue;
    auto sp = seqs[i].getSampling();
    sampling_params p;
    p.temperature = sp.getTemperature();
    p.top_k = sp.getTopK();
    p.top_p = sp.getTopP();
    p.seed = token_seed(sp.getSeed(), seqs[i].getTokenIndex());
    sampler smp(p);
    std::span<const float> lg(st.logits.data() + row * size_t(n_vocab), size_t(n_vocab));
    out[i] = smp.sample(lg);
    ++row;
  }
  auto us =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
  st.batches += 1;
  st.tokens += n_tok;
  st.forward_ms.observe(double(us) / 1000.0);
  st.log->debug("{} batch: {} seqs, {} tokens, {} us", fb.getPhase().cStr(), seqs.size(), n_tok, us);
  return make_wire([&](schema::Envelope::Builder env2) {
    auto r = env2.initForwardResult();
    fill_list([&](unsigned n) { return r.initTokens(n); }, out);
    r.setElapsedUs(us);
  });
}

caf::behavior worker_actor(caf::stateful_actor<worker_state>* self, std::shared_ptr<llama_model> model,
                           worker_options opt, std::shared_ptr<mailbox_gate> gate,
                           std::shared_ptr<spdlog::logger> log) {
  auto& st = self->state;
  st.model = std::move(model);
  st.opt = opt;
  st.gate = std::move(gate);
  st.log = std::move(log);
  st.pool = std::make_unique<kv_pool>(st.model->layout(opt.page_size), opt.n_pages);
  st.log->info("worker up: pool {} with {} pages ({}), {:.1f} MiB", opt.pool_id, opt.n_pages,
               st.pool->layout().describe(), double(st.pool->bytes()) / (1024.0 * 1024.0));
  return {
      [self](call_atom, const wire& w) -> wire {
        auto& s = self->state;
        s.gate->leave();
        try {
          return run_forward(s, w);
        } catch (const tandem::error& e) {
          ++s.failures;
          s.log->error("forward failed: {}", e.what());
          return fail_result(e);
        } catch (const kj::Exception& e) {
          ++s.failures;
          return fail_result(tandem::error(
              error_kind::failed, fmt::format("malformed forward batch: {}", e.getDescription().cStr())));
        } catch (const std::exception& e) {
          ++s.failures;
          s.log->error("forward failed: {}", e.what());
          return fail_result(
              tandem::error(error_kind::failed, fmt::format("forward pass failed: {}", e.what())));
        }
      },
      [self](stats_atom) -> wire {
        auto& s = self->state;
        std::vector<metric_sample> m = {
            {"worker_batches_total", "", double(s.batches), "counter", "Forward batches run"},
            {"worker_tokens_total", "", double(s.tokens), "counter", "Tokens run through the forward pass"},
            {"worker_failures_total", "", double(s.failures), "counter", "Forward batches that failed"},
            {"kv_pool_bytes", "", double(s.pool->bytes()), "gauge", "Bytes of the device KV pool"},
        };
        return make_stats_wire("worker", m, {&s.forward_ms});
      },
  };
}

}  // namespace

bounded_actor spawn_worker(caf::actor_system& sys, std::shared_ptr<llama_model> model,
                           const worker_options& opt, std::shared_ptr<spdlog::logger> log) {
  auto gate = std::make_shared<mailbox_gate>("worker", opt.mailbox_bound);
  auto h = sys.spawn<caf::detached>(worker_actor, std::move(model), opt, gate, std::move(log));
  return bounded_actor{caf::actor_cast<caf::actor>(h), gate};
}

}  // namespace tandem
