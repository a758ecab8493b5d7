#include "actors/runtime/embedded_cluster.h"

#include <fmt/format.h>

#include <filesystem>

#include "actors/runtime/actor_cluster.h"
#include "kernels/cpu/isa.h"
#include "kernels/gguf/gguf.h"
#include "kernels/grammar/vocab.h"
#include "kernels/model/llama.h"
#include "kernels/tokenizer/tokenizer.h"

namespace tandem {

struct embedded_cluster::impl {
  // Declaration order matters: the cluster (and the model inside its worker) goes first,
  // the mmapped file last.
  gguf::file file;
  std::unique_ptr<tokenizer> tok;
  std::string model_id;
  std::unique_ptr<actor_cluster> cluster;

  explicit impl(gguf::file f) : file(std::move(f)) {}
  ~impl() { cluster.reset(); }
};

std::unique_ptr<embedded_cluster> embedded_cluster::start(const cluster_options& opt) {
  // Before the model loads (plan_node checks them again with the model's layout).
  auto bad = opt.lim.validate();
  if (!bad.empty()) throw tandem::error(error_kind::failed, bad);
  auto p = std::make_unique<impl>(gguf::file::open(opt.model_path));
  p->tok = tokenizer::from_gguf(p->file);
  cpu_options co;
  co.threads = opt.lim.threads;
  co.isa = cpu::parse_isa(opt.kernel_isa);
  co.kv = require_kv_dtype(opt.kv_cache_dtype, "kv cache dtype '" + opt.kv_cache_dtype + "'");
  if (opt.device.active()) co.make_backend = opt.device.make_ops;
  std::shared_ptr<llama_model> model = llama_model::load(p->file, co);
  p->model_id = model->config().name.empty() ? std::filesystem::path(opt.model_path).stem().string()
                                             : model->config().name;
  actor_cluster_options ao;
  static_cast<node_spec&>(ao) = opt;  // the node's settings as given; the plan is made from them
  ao.model_id = p->model_id;
  ao.kernels = opt.device.active() ? opt.device.name
                                    : fmt::format("{}, {} thread{}", cpu::to_string(cpu::resolve_isa(co.isa)),
                                                  co.threads, co.threads == 1 ? "" : "s");
  ao.device = opt.device;
  ao.eos_id = p->tok->eos_id();
  ao.grammar_vocab = grammar::make_grammar_vocab(*p->tok);
  ao.log_level = opt.log_level;
  ao.log_json = opt.log_json;
  if (opt.configure_node) opt.configure_node(ao);
  p->cluster = std::make_unique<actor_cluster>(std::move(model), ao);
  return std::unique_ptr<embedded_cluster>(new embedded_cluster(std::move(p)));
}

embedded_cluster::embedded_cluster(std::unique_ptr<impl> p) : impl_(std::move(p)) {}

embedded_cluster::~embedded_cluster() = default;

void embedded_cluster::submit(completion_request req, event_callback cb) {
  impl_->cluster->submit(std::move(req), std::move(cb));
}
void embedded_cluster::abort(const std::string& request_id) { impl_->cluster->abort(request_id); }
void embedded_cluster::stop_at_stop_string(const std::string& request_id) {
  impl_->cluster->abort(request_id, finish_reason::stop);
}
void embedded_cluster::stop_choice_at_stop_string(const std::string& request_id, int32_t choice) {
  impl_->cluster->abort(request_id, finish_reason::stop, choice);
}
health_info embedded_cluster::health() const { return impl_->cluster->health(); }
stats_info embedded_cluster::stats() const { return impl_->cluster->stats(); }
std::string embedded_cluster::metrics_text() const { return impl_->cluster->metrics_text(); }
const tokenizer& embedded_cluster::tok() const { return *impl_->tok; }
std::string embedded_cluster::model_id() const { return impl_->model_id; }
int32_t embedded_cluster::max_context() const { return impl_->cluster->max_context(); }
node_report embedded_cluster::inspect() const { return impl_->cluster->inspect(); }
node_report embedded_cluster::drain(bool on) { return impl_->cluster->drain(on); }
int32_t embedded_cluster::set_max_queue_wait_ms(int32_t ms) { return impl_->cluster->set_max_queue_wait_ms(ms); }

}  // namespace tandem
