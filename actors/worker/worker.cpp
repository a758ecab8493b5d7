#include "actors/worker/worker.h"

#include <fmt/format.h>

#include <algorithm>
#include <caf/all.hpp>
#include <chrono>
#include <cstring>
#include <map>

#include "actors/cache_tier/page_file.h"
#include "actors/common/pool_pages_wire.h"
#include "actors/common/metrics.h"
#include "actors/common/request.h"
#include "actors/common/logprobs_wire.h"
#include "actors/common/receive.h"
#include "actors/common/seq_pages.h"
#include "actors/common/wire.h"
#include "actors/worker/worker_kv.h"
#include "kernels/backend/page_staging.h"
#include "kernels/model/logprobs.h"
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
  /// The cache tier (an ended send's pages) and the decode scheduler (kvDone). Declared before
  /// `kv`: a port may hand pages back while it is destroyed.
  peer_set peers;
  /// Cross-node KV handoffs (worker_kv.h): the transport port, which owns the pools then, and
  /// the table of the sends and receives it drives.
  std::unique_ptr<worker_kv> kv;
  std::shared_ptr<kv_pools> pools;    ///< every pool of the layout set (borrowed from the port)
  kv_pool* pool = nullptr;            ///< pool 0
  bool tick_pending = false;
  std::vector<metric_sample> extra_metrics;  ///< scratch of the stats handler
  /// L2 slots in host memory: slot h of every pool (a block's pages of each pool).
  std::unique_ptr<kv_pools> host;
  std::vector<uint64_t> layout_fp;  ///< per pool: names its disk files (pool_file_fingerprint)
  int64_t copies = 0, copy_failures = 0;
  /// Host-tier copies of a device pool with staging (device.h): through this bounded ring.
  std::unique_ptr<backend::page_stager> stager;
  std::shared_ptr<mailbox_gate> gate;
  std::shared_ptr<spdlog::logger> log;
  inbox box;  ///< the receive side (gate, log, unexpected-message counters)
  worker_options opt;
  std::vector<float> logits;
  std::unique_ptr<grammar::grammar_sessions> grammars;  ///< with opt.grammar_vocab
  int64_t grammar_us = 0;  ///< time spent masking
  int64_t batches = 0, tokens = 0, failures = 0;
  histogram forward_ms{"worker_forward_ms", "Worker forward pass time (ms)", histogram::latency_ms_buckets()};
  static inline const char* name = "worker";
};

size_t total_bytes(const kv_pools* p) {
  size_t b = 0;
  for (size_t i = 0; p && i < p->size(); ++i) b += (*p)[i].bytes();
  return b;
}

/// Pinned buffers of the host tier's staging ring: enough to keep a copy in flight while
/// earlier ones leave their buffers.
constexpr int32_t k_staging_buffers = 4;

wire fail_result(const tandem::error& e) {
  return make_reply([&](schema::Reply::Builder env) {
    auto r = env.initForwardResult();
    r.setFailed(true);
    set_error(r.initError(), e);
  });
}

/// A transfer order off the wire.
kv_order read_kv_order(schema::KvTransferOrder::Reader o) {
  return kv_order{o.getTransferId(), o.getId().cStr(), o.getPeerNode().cStr(), read_pool_pages(o)};
}

/// The worker's transfer ends, through its typed handles (peers arrive right after the spawn,
/// before any order: the wiring sends them to the worker first).
kv_handoff_outputs kv_outputs(worker_state* st) {
  kv_handoff_outputs out;
  out.free_pages = [st, log = st->log](const std::string& id, pool_pages& pages) {
    if (!st->peers.cache) {
      log->error("request {}: KV send ended before the worker knew its cache tier; its pages are lost", id);
      return;
    }
    send_free_pages(st->peers.cache, id, pages);
  };
  out.receive_done = [st, log = st->log](uint64_t tid, const std::string& id, bool delivered,
                                         const pool_pages& pages, const std::string& why) {
    if (!st->peers.decode) {
      log->error("request {}: KV receive ended before the worker knew its decode scheduler", id);
      return;
    }
    // kv_atom: not gated (protocol.h); one answer per receive order.
    st->peers.decode.send_anon<msg::kv_done>([&](schema::KvTransferDone::Builder d) {
      d.setTransferId(tid);
      d.setId(id);
      d.setDelivered(delivered);
      write_pool_pages(d, pages);
      d.setError(why);
    });
  };
  return out;
}

wire run_forward(worker_state& st, schema::ForwardBatch::Reader fb) {
  auto seqs = fb.getSeqs();
  const int32_t n_vocab = st.model->config().n_vocab;
  const int32_t ps = st.pools->set().page_size();
  // Copy the spans' storage out of the message and validate every index before computing.
  std::vector<std::vector<int32_t>> toks(seqs.size());
  std::vector<pool_pages> pages(seqs.size());
  std::vector<std::vector<std::span<const int32_t>>> tables(seqs.size());
  std::vector<batch_seq> batch(seqs.size());
  const kv_pools_layout& set = st.pools->set();
  int64_t n_tok = 0;
  for (unsigned i = 0; i < seqs.size(); ++i) {
    auto s = seqs[i];
    toks[i] = to_vector(s.getTokens());
    pages[i] = read_pool_pages(s);
    for (auto t : toks[i])
      if (t < 0 || t >= n_vocab)
        return fail_result(tandem::error(
            error_kind::failed, fmt::format("request {}: token id {} is outside the vocabulary [0, {})",
                                            s.getId().cStr(), t, n_vocab)));
    const int64_t need = (int64_t(s.getPos()) + int64_t(toks[i].size()) + ps - 1) / ps;
    if (pages[i].size() != set.pools.size())
      return fail_result(tandem::error(
          error_kind::failed, fmt::format("request {}: page tables for {} pools; this worker's layout has {} ({})",
                                          s.getId().cStr(), pages[i].size(), set.pools.size(), set.describe())));
    for (size_t p = 0; p < pages[i].size(); ++p) {
      // Blocks before a window pool's first live block are never read: -1 is fine there.
      const int64_t live = set.pools[p].first_live_block(s.getPos());
      const int32_t n = (*st.pools)[p].n_pages();
      for (size_t b = 0; b < pages[i][p].size(); ++b) {
        const int32_t x = pages[i][p][b];
        if ((x < 0 && int64_t(b) < live) || (x >= 0 && x < n)) continue;
        return fail_result(tandem::error(
            error_kind::failed, fmt::format("request {}: page id {} of block {} outside the '{}' pool of {} pages",
                                            s.getId().cStr(), x, b, set.pools[p].name, n)));
      }
    }
    if (toks[i].empty() || s.getPos() < 0 || int64_t(pages[i][0].size()) < need)
      return fail_result(tandem::error(
          error_kind::failed, fmt::format("request {}: bad forward step (pos {}, {} tokens, {} pages)",
                                          s.getId().cStr(), s.getPos(), toks[i].size(), pages[i][0].size())));
    for (size_t p = 1; p < pages[i].size(); ++p)
      if (int64_t(pages[i][p].size()) < need)
        return fail_result(tandem::error(
            error_kind::failed, fmt::format("request {}: the '{}' pool's page table has {} blocks, the step needs {}",
                                            s.getId().cStr(), set.pools[p].name, pages[i][p].size(), need)));
    for (const auto& t : pages[i]) tables[i].emplace_back(t);
    batch[i].tokens = toks[i];
    batch[i].pos = s.getPos();
    batch[i].pages = pages[i][0];
    if (pages[i].size() > 1) batch[i].pool_pages = tables[i];
    batch[i].want_logits = s.getSample();
    n_tok += int64_t(toks[i].size());
  }
  auto t0 = std::chrono::steady_clock::now();
  std::vector<int32_t> out(seqs.size(), -1);
  std::vector<token_logprobs> lps;  // one per seq once any asked
  // On a device backend the logits stay there when every sampled row draws from the raw
  // logits (no logit_bias, penalties, min_p or grammar, which need the host's history and
  // masks): the backend draws, and only tokens and the asked logprobs come back.
  std::vector<sample_row> draws;
  bool on_device = st.model->on_device();
  for (unsigned i = 0; on_device && i < seqs.size(); ++i) {
    if (!batch[i].want_logits) continue;
    sampling_params p = read_sampling(seqs[i].getSampling());
    p.seed = token_seed(p.seed, seqs[i].getTokenIndex());
    on_device = samples_raw(p) && p.validate().empty();  // bad parameters fail on the host path
    draws.push_back(sample_row_of(p, seqs[i].getLogprobs()));
  }
  if (on_device) {
    std::vector<token_logprobs> drawn;
    st.model->forward_sample(batch, *st.pools, draws, drawn);
    size_t r = 0;
    for (unsigned i = 0; i < seqs.size(); ++i) {
      if (!batch[i].want_logits) continue;
      out[i] = drawn[r].token;
      if (seqs[i].getLogprobs() >= 0) {
        lps.resize(seqs.size());
        lps[i] = std::move(drawn[r]);
      }
      ++r;
    }
  } else {
    st.model->forward(batch, *st.pools, st.logits);
  }
  size_t row = 0;
  for (unsigned i = 0; !on_device && i < seqs.size(); ++i) {
    if (!batch[i].want_logits) continue;
    sampling_params p = read_sampling(seqs[i].getSampling());
    p.seed = token_seed(p.seed, seqs[i].getTokenIndex());
    sampler smp(p);
    std::span<const float> lg(st.logits.data() + row * size_t(n_vocab), size_t(n_vocab));
    auto hp = seqs[i].getPenaltyPrompt();
    auto hg = seqs[i].getPenaltyGenerated();
    const std::vector<int32_t> prompt_hist = to_vector(hp), gen_hist = to_vector(hg);
    const std::string id = seqs[i].getId().cStr();
    if (p.grammar.active()) {
      if (!st.grammars)
        throw tandem::error(error_kind::failed, fmt::format("request {}: this worker was started without the model's "
                                                            "vocabulary, so it cannot apply response_format", id));
      auto g0 = std::chrono::steady_clock::now();
      st.grammars->constrain(id, p.grammar, gen_hist,
                             std::span<float>(st.logits.data() + row * size_t(n_vocab), size_t(n_vocab)));
      st.grammar_us += std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - g0).count();
    }
    out[i] = smp.sample(lg, {prompt_hist, gen_hist});
    if (p.grammar.active()) st.grammars->accepted(id, out[i]);
    if (const int32_t top = seqs[i].getLogprobs(); top >= 0) {
      lps.resize(seqs.size());
      lps[i] = compute_logprobs(lg, p, {prompt_hist, gen_hist}, out[i], top);
    }
    ++row;
  }
  auto us =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
  st.batches += 1;
  st.tokens += n_tok;
  st.forward_ms.observe(double(us) / 1000.0);
  st.log->debug("{} batch: {} seqs, {} tokens, {} us", fb.getPhase() == schema::StageRole::DECODE ? "decode" : "prefill", seqs.size(), n_tok, us);
  return make_reply([&](schema::Reply::Builder env2) {
    auto r = env2.initForwardResult();
    fill_list([&](unsigned n) { return r.initTokens(n); }, out);
    write_logprobs([&](unsigned n) { return r.initLogprobs(n); }, lps);
    r.setElapsedUs(us);
  });
}

/// A run of host-tier copies one way (device to host or host to device) staged together
/// through the worker's pinned ring; a copy the other way or an op of another kind ends it.
struct staged_run {
  bool to_host = false;
  std::vector<backend::page_copy> copies;
  std::vector<uint32_t> ops;  ///< their indices in the CacheCopy
};

wire run_copy(worker_state& st, schema::CacheCopy::Reader cc) {
  auto t0 = std::chrono::steady_clock::now();
  std::vector<uint32_t> failed;
  std::string first_error;
  uint64_t bytes = 0;
  auto ops = cc.getOps();
  auto fail = [&](uint32_t i, std::string why) {
    failed.push_back(i);
    if (first_error.empty()) first_error = std::move(why);
  };
  staged_run staged;
  // Runs the pending staged copies; if they fail, every op of the run fails with the reason.
  auto flush = [&] {
    if (staged.copies.empty()) return;
    try {
      if (staged.to_host)
        st.stager->to_host(staged.copies);
      else
        st.stager->to_device(staged.copies);
      for (const auto& c : staged.copies) bytes += c.bytes;
    } catch (const std::exception& e) {
      for (uint32_t o : staged.ops) fail(o, e.what());
    }
    staged.copies.clear();
    staged.ops.clear();
  };
  for (uint32_t i = 0; i < ops.size(); ++i) {
    auto op = ops[i];
    const int32_t d = op.getDevice(), h = op.getHost();
    const int32_t pi = op.getPool();
    if (pi < 0 || size_t(pi) >= st.pools->size()) {
      fail(i, fmt::format("pool {} of a layout of {} pools", pi, st.pools->size()));
      continue;
    }
    kv_pool& dev = (*st.pools)[size_t(pi)];
    kv_pool* host = st.host ? &(*st.host)[size_t(pi)] : nullptr;
    const size_t pb = dev.page_bytes();
    const uint64_t fp = st.layout_fp[size_t(pi)];
    const bool d_ok = d >= 0 && d < dev.n_pages();
    const bool h_ok = host && h >= 0 && h < host->n_pages();
    auto kind = op.getKind();
    const bool staged_kind = st.stager && (kind == schema::CacheOpKind::DEVICE_TO_HOST ||
                                           kind == schema::CacheOpKind::HOST_TO_DEVICE);
    if (!staged_kind || (kind == schema::CacheOpKind::DEVICE_TO_HOST) != staged.to_host) flush();
    if (kind == schema::CacheOpKind::DEVICE_TO_DEVICE) {
      // A fork's copy-on-write: the block it writes first gets its own page.
      const int32_t to = op.getDeviceTo();
      if (!d_ok || to < 0 || to >= dev.n_pages() || to == d) {
        fail(i, fmt::format("device copy {} -> {} outside the pool of {} pages", d, to, dev.n_pages()));
        continue;
      }
      if (st.opt.device.copy) st.opt.device.copy(dev.page_data(to), dev.page_data(d), pb);
      else std::memcpy(dev.page_data(to), dev.page_data(d), pb);
      bytes += pb;
      continue;
    }
    if (kind != schema::CacheOpKind::DROP_DISK && !h_ok) {
      fail(i, fmt::format("host page {} outside the host pool of {} pages", h, host ? host->n_pages() : 0));
      continue;
    }
    try {
      switch (kind) {
        case schema::CacheOpKind::DEVICE_TO_HOST:
        case schema::CacheOpKind::HOST_TO_DEVICE:
          if (!d_ok) {
            fail(i, fmt::format("device page {} outside the pool of {} pages", d, dev.n_pages()));
            continue;
          }
          // Device memory (a GPU's pool) copies through the device's pinned staging ring
          // (batched: a run of copies one way shares the ring), else through the device's
          // copy; host memory directly.
          if (staged_kind) {
            staged.to_host = kind == schema::CacheOpKind::DEVICE_TO_HOST;
            staged.copies.push_back(staged.to_host ? backend::page_copy{host->page_data(h), dev.page_data(d), pb}
                                                   : backend::page_copy{dev.page_data(d), host->page_data(h), pb});
            staged.ops.push_back(i);
            break;  // its bytes count once the run is done
          }
          if (kind == schema::CacheOpKind::DEVICE_TO_HOST) {
            if (st.opt.device.copy) st.opt.device.copy(host->page_data(h), dev.page_data(d), pb);
            else std::memcpy(host->page_data(h), dev.page_data(d), pb);
          } else {
            if (st.opt.device.copy) st.opt.device.copy(dev.page_data(d), host->page_data(h), pb);
            else std::memcpy(dev.page_data(d), host->page_data(h), pb);
          }
          bytes += pb;
          break;
        case schema::CacheOpKind::HOST_TO_DISK: {
          if (st.opt.disk_dir.empty()) throw tandem::error("no disk tier configured");
          auto toks = to_vector(op.getTokens());
          write_page_file(st.opt.disk_dir, fp, op.getHash(), op.getParent(), toks, host->page_data(h), pb);
          bytes += pb;
          break;
        }
        case schema::CacheOpKind::DISK_TO_HOST: {
          if (st.opt.disk_dir.empty()) throw tandem::error("no disk tier configured");
          auto toks = to_vector(op.getTokens());
          std::string why;
          if (!read_page_file(st.opt.disk_dir, fp, op.getHash(), op.getParent(), toks, host->page_data(h), pb,
                              why)) {
            fail(i, why);
            continue;
          }
          bytes += pb;
          break;
        }
        case schema::CacheOpKind::DROP_DISK:
          if (!st.opt.disk_dir.empty()) remove_page_file(st.opt.disk_dir, fp, op.getHash());
          break;
        case schema::CacheOpKind::DEVICE_TO_DEVICE:
          break;  // handled above
      }
    } catch (const std::exception& e) {
      fail(i, e.what());
    }
  }
  flush();
  std::sort(failed.begin(), failed.end());
  auto us =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
  st.copies += ops.size();
  st.copy_failures += static_cast<int64_t>(failed.size());
  if (!first_error.empty()) st.log->warn("cache copy {}: {} of {} ops failed: {}", cc.getId().cStr(), failed.size(),
                                         ops.size(), first_error);
  return make_reply([&](schema::Reply::Builder env) {
    auto r = env.initCacheCopyReply();
    auto fl = r.initFailed(static_cast<unsigned>(failed.size()));
    for (unsigned i = 0; i < failed.size(); ++i) fl.set(i, failed[i]);
    r.setError(first_error);
    r.setBytes(bytes);
    r.setElapsedUs(us);
  });
}

caf::behavior worker_actor(caf::stateful_actor<worker_state>* self, std::shared_ptr<llama_model> model,
                           worker_options opt, std::shared_ptr<mailbox_gate> gate,
                           std::shared_ptr<spdlog::logger> log) {
  // A failure's message travels in the exit reason, so the supervisor's report names it
  // (CAF's default handler keeps only "runtime_error").
  self->set_exception_handler([](caf::scheduled_actor*, std::exception_ptr& eptr) -> caf::error {
    try {
      std::rethrow_exception(eptr);
    } catch (const std::exception& e) {
      return caf::make_error(caf::sec::runtime_error, std::string(e.what()));
    } catch (...) {
      return caf::make_error(caf::sec::runtime_error, std::string("unknown exception"));
    }
  });
  auto& st = self->state;
  st.model = std::move(model);
  st.opt = opt;
  st.gate = std::move(gate);
  st.log = std::move(log);
  st.box = inbox{"worker", st.gate, st.log};
  if (opt.grammar_vocab)
    st.grammars = std::make_unique<grammar::grammar_sessions>(opt.grammar_vocab, opt.grammar_limits);
  if (opt.fail_at_start)
    throw tandem::error(error_kind::failed,
                        fmt::format("worker of pool {} failed at start (injected: TANDEM_WORKER_FAULT=start)", opt.pool_id));
  if (opt.pools.pools.empty())
    throw tandem::error(error_kind::failed, fmt::format("worker of pool {}: no KV layout set; pass worker_options::pools "
                                                        "(the node plan's, worker_options_of)",
                                                        opt.pool_id));
  const kv_pools_layout set = opt.pools.pools.size() > 1
                                  ? opt.pools
                                  : kv_pools_layout::single(st.model->layout(opt.pools.page_size()));
  std::vector<int32_t> n_pages{opt.n_pages};
  for (size_t p = 1; p < set.pools.size(); ++p)
    n_pages.push_back(p - 1 < opt.extra_pages.size() ? opt.extra_pages[p - 1] : 0);
  if (opt.kv_transfer) {
    st.kv = std::make_unique<worker_kv>(size_t(std::max(1, opt.kv_transfer_max_live)), kv_outputs(&st), st.log);
    // The port allocates and registers every pool, so peers write into them directly.
    st.kv->open(opt.kv_transfer, set, n_pages);
    st.pools = std::shared_ptr<kv_pools>(&st.kv->port().pools(), [](kv_pools*) {});  // the port's
  } else {
    st.pools = opt.device.make_pools ? opt.device.make_pools(set, n_pages) : std::make_shared<kv_pools>(set, n_pages);
  }
  st.pool = &(*st.pools)[0];
  if (opt.device.staging.active() && opt.host_pages > 0) {
    // The host tier's copies of a device pool: a ring of pinned buffers of a page each (the
    // largest pool's), allocated once; a batch of copies pipelines through it.
    size_t page = 0;
    for (size_t p = 0; p < st.pools->size(); ++p) page = std::max(page, (*st.pools)[p].page_bytes());
    st.stager = std::make_unique<backend::page_stager>(opt.device.staging, k_staging_buffers, page);
  }
  for (size_t p = 0; p < set.pools.size(); ++p) st.layout_fp.push_back(pool_file_fingerprint(set, p));
  if (opt.host_pages > 0) {
    std::vector<int32_t> slots(set.pools.size(), opt.host_pages);
    for (size_t p = 1; p < slots.size() && p - 1 < opt.extra_host_pages.size(); ++p)
      slots[p] = opt.extra_host_pages[p - 1];
    st.host = std::make_unique<kv_pools>(set, slots);
    size_t bytes = 0;
    for (size_t p = 0; p < st.host->size(); ++p) bytes += (*st.host)[p].bytes();
    st.log->info("worker: host KV pool of {} pages ({} pools), {:.1f} MiB", opt.host_pages, slots.size(),
                 double(bytes) / (1024.0 * 1024.0));
  }
  if (st.kv) {
    st.tick_pending = true;
    self->send(self, tick_atom::value);
  }
  for (size_t p = 0; p < st.pools->size(); ++p)
    st.log->info("worker up: pool {} '{}' with {} pages ({}), {:.1f} MiB", opt.pool_id, set.pools[p].name,
                 (*st.pools)[p].n_pages(), set.pools[p].describe(), double((*st.pools)[p].bytes()) / (1024.0 * 1024.0));
  return {
      [self](call_atom, const wire& w) -> wire {
        auto& s = self->state;
        return receive_call<worker_role, wire>(
            s.box, w,
            overloaded{
                [&s](msg::forward, schema::ForwardBatch::Reader fb) { return run_forward(s, fb); },
                [&s](msg::cache_copy, schema::CacheCopy::Reader cc) { return run_copy(s, cc); },
            },
            [&s](const tandem::error& e) {
              ++s.failures;
              s.log->error("forward failed: {}", e.what());
              return fail_result(e);
            });
      },
      [self](peers_atom, const peer_set& p) { self->state.peers = p; },
      [self](kv_atom, const wire& w) {
        auto& s = self->state;
        if (!s.kv) {
          s.log->error("worker: KV transfer order without a transfer port (node has no kv_port)");
          return;
        }
        receive<worker_role, kv_atom>(
            s.box, w,
            overloaded{
                [&s](msg::kv_abort, schema::KvTransferOrder::Reader o) {
                  s.kv->abort(o.getId().cStr(), o.getTransferId());
                },
                [&s](msg::kv_send, schema::KvTransferOrder::Reader o) { s.kv->send(read_kv_order(o)); },
                [&s](msg::kv_receive, schema::KvTransferOrder::Reader o) { s.kv->receive(read_kv_order(o)); },
            });
        s.kv->port().progress();
        if (!s.tick_pending) {
          s.tick_pending = true;
          self->send(self, tick_atom::value);
        }
      },
      [self](tick_atom) {
        auto& s = self->state;
        s.tick_pending = false;
        if (!s.kv) return;
        // Spin while transfers move (a busy progress loop is what keeps tcp puts landing);
        // otherwise look for new connections now and then.
        bool moved = false;
        for (int i = 0; i < 64 && s.kv->port().progress(); ++i) moved = true;
        s.tick_pending = true;
        if (moved || s.kv->port().busy())
          self->send(self, tick_atom::value);
        else
          self->delayed_send(self, std::chrono::milliseconds(5), tick_atom::value);
      },
      [self](stats_atom) -> wire {
        auto& s = self->state;
        if (s.kv)
          for (auto& x : s.kv->metrics()) s.extra_metrics.push_back(std::move(x));
        std::vector<metric_sample> m = {
            {"worker_batches_total", "", double(s.batches), "counter", "Forward batches run"},
            {"worker_tokens_total", "", double(s.tokens), "counter", "Tokens run through the forward pass"},
            {"worker_failures_total", "", double(s.failures), "counter", "Forward batches that failed"},
            {"kv_pool_bytes", "", double(total_bytes(s.pools.get())), "gauge",
             "Bytes of the device KV pools (every pool of the layout)"},
            {"kv_host_pool_bytes", "", double(total_bytes(s.host.get())), "gauge",
             "Bytes of the host KV pool (L2)"},
            {"worker_cache_copy_ops_total", "", double(s.copies), "counter", "Cache tier page copy ops run"},
            {"worker_cache_copy_failures_total", "", double(s.copy_failures), "counter",
             "Cache tier page copy ops that failed (bad checksum, missing file, I/O)"},
        };
        const backend::page_stager* sg = s.stager.get();
        m.push_back({"worker_staging_copies_total", "", double(sg ? sg->copies() : 0), "counter",
                     "Host-tier page copies of a device KV pool through the pinned staging ring"});
        m.push_back({"worker_staging_buffer_waits_total", "", double(sg ? sg->buffer_waits() : 0), "counter",
                     "Staged copies that waited for a ring buffer still in flight (the ring never grows)"});
        m.push_back({"worker_staging_buffers_busy", "", double(sg ? sg->busy() : 0), "gauge",
                     "Pinned staging buffers holding a copy (0 between copy batches)"});
        const grammar::grammar_sessions::counters gc = s.grammars ? s.grammars->stats() : grammar::grammar_sessions::counters{};
        m.push_back({"worker_grammar_steps_total", "", double(gc.steps), "counter",
                     "Sampling steps masked by a response_format grammar"});
        m.push_back({"worker_grammar_replays_total", "", double(gc.replays), "counter",
                     "Grammar states rebuilt from a sequence's generated tokens (after a KV handoff, a recompute)"});
        m.push_back({"worker_grammar_compiles_total", "", double(gc.compiles), "counter",
                     "Grammars compiled (a bounded cache keeps them per spec)"});
        m.push_back({"worker_grammar_rebuilds_total", "", double(gc.rebuilds), "counter",
                     "Grammar automata dropped and rebuilt because their stack table filled up"});
        m.push_back({"worker_grammar_sequences", "", double(s.grammars ? s.grammars->n_seqs() : 0), "gauge",
                     "Per-sequence grammar states held (bounded; least recently used out first)"});
        m.push_back({"worker_grammar_mask_seconds_total", "", double(s.grammar_us) / 1e6, "counter",
                     "Time spent computing and applying grammar masks"});
        // CUDA graphs of decode steps (all 0 on the CPU backend).
        const backend::graph_stats gs = s.model->graph_counters();
        m.push_back({"worker_decode_graph_replays_total", "", double(gs.replays), "counter",
                     "Decode steps run through a kept CUDA graph"});
        m.push_back({"worker_decode_graph_captures_total", "", double(gs.captures), "counter",
                     "CUDA graphs made for decode steps (first capture of a shape or re-instantiation)"});
        m.push_back({"worker_decode_graph_failures_total", "", double(gs.failures), "counter",
                     "Decode step shapes whose graph capture failed (they run eagerly)"});
        m.push_back({"worker_decode_graph_evictions_total", "", double(gs.evictions), "counter",
                     "Decode step graphs dropped for the bound"});
        m.push_back({"worker_decode_graphs", "", double(gs.graphs), "gauge", "Decode step graphs kept (bounded)"});
        for (auto& x : s.extra_metrics) m.push_back(std::move(x));
        s.extra_metrics.clear();
        for (auto& x : s.box.metrics()) m.push_back(std::move(x));
        return make_stats_wire("worker", m, {&s.forward_ms});
      },
  };
}

}  // namespace

bounded_actor spawn_worker(caf::actor_system& sys, std::shared_ptr<llama_model> model,
                           const worker_options& opt, std::shared_ptr<spdlog::logger> log) {
  auto gate = std::make_shared<mailbox_gate>("worker", opt.mailbox_bound);
  caf::actor h = opt.detached ? sys.spawn<caf::detached>(worker_actor, std::move(model), opt, gate, std::move(log))
                              : sys.spawn(worker_actor, std::move(model), opt, gate, std::move(log));
  return bounded_actor{h, gate};
}

}  // namespace tandem
