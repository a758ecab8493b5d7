#pragma once
// One node's actor_cluster (cluster_rig: over a model object; embedded_rig: a model file through
// embedded_cluster) on CAF's test scheduler (tests/actors/test_system.h): its actors run
// in FIFO order on the test's own thread, its clock is the scheduler's (advance_ms), and its
// worker runs on the scheduler (actor_cluster_options::system). submit and abort only send; a
// wait (a collector's, a forward gate's, wait_stats) runs the actors until its condition holds
// and fails at once, naming it, when they go quiet first.
//
// The cluster's queries (stats, snapshots, metrics, inspect, drain, the queue-wait bound, its
// shutdown) wait in a scoped_actor for each answer. While one runs, the rig answers for the
// scheduler: every enqueue runs the actors until they are quiet, so the answer is in the
// scoped_actor's mailbox when it looks. A forward gate (tests/actors/support.h) holds the
// worker's jobs while its next message is a forward pass and the gate's pass `pause_at` would be
// next; a query to a held worker would wait forever (stats() and wait_stats() leave it out).
#include <caf/all.hpp>
#include <caf/scheduler/test_coordinator.hpp>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "actors/runtime/actor_cluster.h"
#include "actors/runtime/embedded_cluster.h"
#include "kernels/tokenizer/tokenizer.h"
#include "tests/actors/support.h"
#include "tests/actors/test_system.h"

namespace tandem::test {

/// What both rigs share: the system, the hooks the waits use, the held worker, the answering.
class node_rig : public test_system {
 public:
  node_rig() {
    start();
    runnable = [](caf::resumable* job) { return !(held() && forward_next(job)); };
    auto& h = current_scheduler();
    h.pump = [this](const std::function<bool()>& ok, const std::string& what) { return run_until(ok, what); };
    h.worker_waiting = [this] {
      for (auto* job : sched->jobs)
        if (forward_next(job)) return true;
      return false;
    };
  }
  ~node_rig() {
    current_scheduler() = scheduler_hooks{};
    shutdown({});
  }
  node_rig(const node_rig&) = delete;
  node_rig& operator=(const node_rig&) = delete;

  /// Runs `f` (a blocking query of the cluster) with every enqueue running the actors.
  template <class F>
  auto answering(F f) -> decltype(f()) {
    run();  // every actor idle: the query's first message then schedules its target
    answering_ = true;
    arm();
    struct disarm {
      node_rig* r;
      ~disarm() {
        r->answering_ = false;
        r->sched->after_next_enqueue(std::function<void()>{});
      }
    } d{this};
    return f();
  }

 protected:
  /// The cluster's options for this rig: its system and clock.
  void wire_into(actor_cluster_options& o) {
    o.system = sys.get();
    o.clock = clk;
  }

 private:
  bool answering_ = false, in_run_ = false;

  /// `job` is the worker and the next message it takes is a forward pass (or a cache copy: the
  /// worker's calls). Peeking is safe here: no actor runs while the test thread looks. (Through
  /// libcaf's own peek: CAF's intrusive queue headers, inlined here, trip UBSan's downcast check.)
  static bool forward_next(caf::resumable* job) {
    auto* a = dynamic_cast<caf::scheduled_actor*>(job);
    if (!a || std::strcmp(a->name(), "worker") != 0) return false;
    auto* next = a->peek_at_next_mailbox_element();
    return next && next->content().match_elements<call_atom, wire>();
  }
  /// A live forward gate holds the worker before its next forward pass.
  static bool held() {
    for (auto* g : forward_gate::live())
      if (g->holds()) return true;
    return false;
  }
  void arm() {
    sched->after_next_enqueue([this] { on_enqueue(); });
  }
  void on_enqueue() {
    if (!answering_) return;
    arm();
    if (in_run_) return;  // an actor's own send while the rig runs them
    in_run_ = true;
    run();
    in_run_ = false;
  }
};

/// An actor_cluster over a model object (the fake model) on the test scheduler.
/// The blocking queries of a cluster (`Rig::target()`), each answered with the actors running.
template <class Rig>
class cluster_queries {
 public:
  stats_info stats() {
    return rig().answering([&] { return rig().target().stats(); });
  }
  std::string metrics_text() {
    return rig().answering([&] { return rig().target().metrics_text(); });
  }
  health_info health() {
    return rig().answering([&] { return rig().target().health(); });
  }
  node_report inspect() {
    return rig().answering([&] { return rig().target().inspect(); });
  }
  node_report drain(bool on) {
    return rig().answering([&] { return rig().target().drain(on); });
  }
  int32_t set_max_queue_wait_ms(int32_t ms) {
    return rig().answering([&] { return rig().target().set_max_queue_wait_ms(ms); });
  }

 private:
  Rig& rig() { return static_cast<Rig&>(*this); }
};

class cluster_rig : public node_rig, public cluster_queries<cluster_rig> {
 public:
  /// The cluster over `model` with `o` (its system and clock are the rig's).
  cluster_rig(std::shared_ptr<llama_model> model, actor_cluster_options o) {
    wire_into(o);
    c_ = std::make_unique<actor_cluster>(std::move(model), std::move(o));
    run();  // the actors' start: peers, first credits
  }
  ~cluster_rig() {
    answering([&] {
      c_.reset();
      return 0;
    });
  }

  actor_cluster& cluster() { return *c_; }
  actor_cluster& target() { return *c_; }
  void submit(completion_request req, event_callback cb) { c_->submit(std::move(req), std::move(cb)); }
  void abort(const std::string& id, finish_reason why = finish_reason::abort, int32_t choice = -1) {
    c_->abort(id, why, choice);
  }
  void inject_failure(const std::string& role, const std::string& cause = "injected failure") {
    c_->inject_failure(role, cause);
  }
  int32_t n_pages() const { return c_->n_pages(); }
  int32_t max_context() const { return c_->max_context(); }

  std::vector<stats_snapshot> snapshots(bool include_worker = true) {
    return answering([&] { return c_->snapshots(include_worker); });
  }

 private:
  std::unique_ptr<actor_cluster> c_;
};

/// An embedded_cluster (a model file loaded) on the test scheduler: its forward passes run on
/// the test's thread.
class embedded_rig : public node_rig, public cluster_queries<embedded_rig> {
 public:
  explicit embedded_rig(cluster_options o) {
    auto node = o.configure_node;
    o.configure_node = [this, node](actor_cluster_options& ao) {
      if (node) node(ao);
      wire_into(ao);
    };
    c_ = embedded_cluster::start(o);
    run();
  }
  ~embedded_rig() {
    answering([&] {
      c_.reset();
      return 0;
    });
  }

  embedded_cluster& cluster() { return *c_; }
  embedded_cluster& target() { return *c_; }
  void submit(completion_request req, event_callback cb) { c_->submit(std::move(req), std::move(cb)); }
  void abort(const std::string& id) { c_->abort(id); }
  void stop_at_stop_string(const std::string& id) { c_->stop_at_stop_string(id); }
  void stop_choice_at_stop_string(const std::string& id, int32_t choice) { c_->stop_choice_at_stop_string(id, choice); }
  const tokenizer& tok() const { return c_->tok(); }
  std::string model_id() const { return c_->model_id(); }
  int32_t max_context() const { return c_->max_context(); }

 private:
  std::unique_ptr<embedded_cluster> c_;
};

/// After the actors are quiet, whether `pred(stats)` holds (the stats leave the worker out).
template <class Pred>
bool wait_stats(cluster_rig& c, Pred pred) {
  c.run();
  return pred(c.stats());
}

}  // namespace tandem::test
