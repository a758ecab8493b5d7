#include "kernels/backend/cuda/device_sampler.h"

#include <fmt/format.h>

#include <algorithm>

#include "kernels/base/error.h"

namespace tandem::backend::cuda_detail {

namespace k = tandem::cuda_backend;
static_assert(k::k_max_top_logprobs == max_top_logprobs, "the device keeps as many top logprobs as the API allows");

device_sampler::device_sampler(cudaStream_t s, host_staging* staging)
    : stream_(s),
      descs_(s, staging),
      sorted_rows_(s, staging),
      offsets_(s, staging),
      keys_in_(s, staging),
      keys_out_(s, staging),
      ids_in_(s, staging),
      ids_out_(s, staging),
      scratch_(s, staging),
      results_(s, staging) {}

void device_sampler::run(const float* logits, int64_t n_vocab, std::span<const sample_row> rows,
                         std::span<token_logprobs> out) {
  if (out.size() != rows.size())
    throw tandem::error(fmt::format("sample: {} output slots for {} rows; give one per row", out.size(), rows.size()));
  if (rows.empty()) return;
  if (n_vocab <= 0 || n_vocab > (int64_t(1) << 30))
    throw tandem::error(fmt::format("cuda sample: a vocabulary of {} is out of range (1 .. 2^30)", n_vocab));
  host_descs_.resize(rows.size());
  host_sorted_.clear();
  bool any_logprobs = false;
  for (size_t i = 0; i < rows.size(); ++i) {
    const sample_row& r = rows[i];
    if (!(r.uniform >= 0.0 && r.uniform < 1.0))
      throw tandem::error(fmt::format("sample: row {}'s uniform draw {} is outside [0, 1)", i, r.uniform));
    k::sample_desc& d = host_descs_[i];
    d = k::sample_desc{.temperature = r.temperature,
                       .top_k = r.top_k,
                       .top_p = r.top_p,
                       .top_n = r.top_logprobs < 0 ? -1 : std::min(r.top_logprobs, k::k_max_top_logprobs),
                       .uniform = r.uniform};
    if (k::sample_needs_sort(d, n_vocab)) {
      d.sorted = int32_t(host_sorted_.size());
      host_sorted_.push_back(int32_t(i));
    }
    any_logprobs = any_logprobs || d.top_n >= 0;
  }
  const int64_t n = int64_t(rows.size()), m = int64_t(host_sorted_.size());
  const auto* descs = static_cast<const k::sample_desc*>(descs_.upload(host_descs_.data(), host_descs_.size() * sizeof(k::sample_desc)));
  const float* keys = nullptr;
  const int32_t* ids = nullptr;
  if (m > 0) {
    if (m * n_vocab > int64_t(0x7fffffff))
      throw tandem::error(fmt::format("cuda sample: {} top-k/top-p rows of {} exceed one sort's 2^31 entries; sample "
                                      "fewer rows per step",
                                      m, n_vocab));
    host_offsets_.resize(size_t(m + 1));
    for (int64_t j = 0; j <= m; ++j) host_offsets_[size_t(j)] = int32_t(j * n_vocab);
    const auto* rows_d = static_cast<const int32_t*>(sorted_rows_.upload(host_sorted_.data(), size_t(m) * 4));
    const auto* offs = static_cast<const int32_t*>(offsets_.upload(host_offsets_.data(), size_t(m + 1) * 4));
    const size_t cells = size_t(m * n_vocab);
    auto* kin = static_cast<float*>(keys_in_.get(cells * 4));
    auto* kout = static_cast<float*>(keys_out_.get(cells * 4));
    auto* iin = static_cast<int32_t*>(ids_in_.get(cells * 4));
    auto* iout = static_cast<int32_t*>(ids_out_.get(cells * 4));
    check(k::sort_keys(logits, n_vocab, descs, rows_d, m, kin, iin, stream_), "scaling logits for the sort");
    const size_t bytes = k::sort_scratch_bytes(m, n_vocab);
    void* tmp = scratch_.get(std::max<size_t>(bytes, 16));
    check(k::sort_rows_desc(tmp, bytes, kin, kout, iin, iout, m, n_vocab, offs, stream_), "sorting logits rows");
    keys = kout;
    ids = iout;
  }
  auto* res = static_cast<k::sample_out*>(results_.get(size_t(n) * sizeof(k::sample_out)));
  check(k::draw_tokens(logits, n_vocab, descs, n, keys, ids, res, stream_), "drawing tokens");
  if (any_logprobs) check(k::token_logprobs(logits, n_vocab, descs, n, res, stream_), "computing logprobs");
  host_out_.resize(size_t(n));
  check(cudaMemcpyAsync(host_out_.data(), res, size_t(n) * sizeof(k::sample_out), cudaMemcpyDeviceToHost, stream_),
        "copying the drawn tokens to the host");
  check(cudaStreamSynchronize(stream_), "running the sampling kernels");
  for (size_t i = 0; i < rows.size(); ++i) {
    const k::sample_out& o = host_out_[i];
    token_logprobs& t = out[i];
    t = token_logprobs{.token = o.token};
    if (host_descs_[i].top_n < 0) continue;
    t.logprob = o.logprob;
    for (int j = 0; j < o.n_top && j < k::k_max_top_logprobs; ++j)
      t.top.push_back(top_logprob{o.top_ids[j], o.top_logprobs[j]});
  }
}

}  // namespace tandem::backend::cuda_detail
