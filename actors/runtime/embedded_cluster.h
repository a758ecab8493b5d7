#pragma once
/// All roles (router, prefill scheduler, decode scheduler, worker, cache tier) in one process.
/// The request still goes router -> prefill -> KV handoff -> decode through the same
/// serialized messages that cross nodes in a disaggregated deployment.
#include <functional>
#include <memory>
#include <string>

#include "actors/common/cache_config.h"
#include "actors/common/limits.h"
#include "actors/runtime/node_plan.h"
#include "actors/runtime/serving_api.h"
#include "kernels/backend/device.h"

namespace tandem {

struct actor_cluster_options;

/// A node's settings (node_spec: limits, cache, name, roles, links, router policy) and how to
/// load its model.
struct cluster_options : node_spec {
  std::string model_path;           ///< GGUF file
  std::string log_level = "info";   ///< spdlog level name
  bool log_json = false;
  /// What the running process adds to the actor cluster's options (the KV transfer port of a
  /// node whose prefill and decode run apart, supervision hooks); model_id is already filled in.
  std::function<void(actor_cluster_options&)> configure_node;
  std::string kernel_isa = "best";            ///< CPU kernel path ([model] kernels; cpu::parse_isa names)
  std::string kv_cache_dtype = "f32";         ///< KV cache element type ([model] kv_cache_dtype: f32 | f16)
  /// The device to run on ([model] backend / device, --backend): its op table and KV pools
  /// (kernels/backend/device.h, e.g. backend::make_cuda_device); empty = the CPU backend.
  backend::device device;
};

class embedded_cluster : public serving_api {
 public:
  /// Loads the model, validates limits, spawns and wires the actors. Throws tandem::error.
  static std::unique_ptr<embedded_cluster> start(const cluster_options& opt);
  /// Stops the actors; requests still running end with a `disconnected` error event.
  ~embedded_cluster() override;

  void submit(completion_request req, event_callback cb) override;
  void abort(const std::string& request_id) override;
  void stop_at_stop_string(const std::string& request_id) override;
  void stop_choice_at_stop_string(const std::string& request_id, int32_t choice) override;
  health_info health() const override;
  stats_info stats() const override;
  std::string metrics_text() const override;
  const tokenizer& tok() const override;
  std::string model_id() const override;
  int32_t max_context() const override;
  node_report inspect() const override;
  node_report drain(bool on) override;
  /// Retunes the queue-wait bound (limits.max_queue_wait_ms, 0 = off) of the running router;
  /// returns the bound it replaced. Throws tandem::error if `ms` < 0 or no router runs here.
  int32_t set_max_queue_wait_ms(int32_t ms);

  struct impl;

 private:
  explicit embedded_cluster(std::unique_ptr<impl> p);
  std::unique_ptr<impl> impl_;
};

}  // namespace tandem
