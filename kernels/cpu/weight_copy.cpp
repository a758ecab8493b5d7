#include "kernels/cpu/weight_copy.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string_view>
#include <utility>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/cpu/huge_pages.h"
#include "kernels/cpu/thread_pool.h"

namespace tandem::cpu {

namespace {

constexpr uint64_t copy_align = 64;  // every copy starts on a cache line, as the kernels expect

uint64_t padded(uint64_t bytes) { return (bytes + copy_align - 1) / copy_align * copy_align; }

// Offsets into the buffer of each distinct (data, size) of `views`, and the buffer's size.
template <class View>
std::pair<std::map<std::pair<const void*, size_t>, uint64_t>, uint64_t> layout(std::span<View> views,
                                                                              auto&& view_of) {
  std::map<std::pair<const void*, size_t>, uint64_t> at;
  uint64_t total = 0;
  for (auto& v : views) {
    const tensor_view& t = view_of(v);
    if (at.emplace(std::pair{t.data, t.nbytes}, total).second) total += padded(t.nbytes);
  }
  return {std::move(at), total};
}

}  // namespace

bool weight_copy_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("TANDEM_COPY_WEIGHTS");
    return v == nullptr || std::string_view(v) != "0";
  }();
  return on;
}

uint64_t weight_copy_bytes(std::span<const tensor_view> views) {
  return layout(views, [](const tensor_view& v) -> const tensor_view& { return v; }).second;
}

std::shared_ptr<const uint8_t> copy_weights(std::span<tensor_view* const> views, thread_pool* pool) {
  auto [at, total] = layout(views, [](tensor_view* v) -> const tensor_view& { return *v; });
  if (total == 0) return nullptr;
  size_t allocated = 0;
  auto* buf = static_cast<uint8_t*>(huge_alloc(total, allocated));
  if (buf == nullptr)
    throw tandem::error(fmt::format(
        "cannot allocate {:.1f} MiB for the in-memory copy of the weights; free memory, or run with "
        "TANDEM_COPY_WEIGHTS=0 (the kernels then read the mmapped file: no copy, slower decode)",
        double(total) / double(1 << 20)));
  std::shared_ptr<uint8_t> copy(buf, huge_free{});
  // Whole weights in 4 MiB pieces, so the threads share a model of a few large tensors evenly
  // (the first touch of each page also decides which thread faults it in).
  constexpr uint64_t piece = uint64_t(4) << 20;
  struct part {
    const uint8_t* src;
    uint8_t* dst;
    uint64_t bytes;
  };
  std::vector<part> parts;
  for (const auto& [key, off] : at)
    for (uint64_t o = 0; o < key.second; o += piece)
      parts.push_back({static_cast<const uint8_t*>(key.first) + o, buf + off + o, std::min<uint64_t>(piece, key.second - o)});
  auto run = [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) std::memcpy(parts[size_t(p)].dst, parts[size_t(p)].src, parts[size_t(p)].bytes);
  };
  if (pool != nullptr && pool->size() > 1 && parts.size() > 1)
    pool->parallel_for(int64_t(parts.size()), run);
  else
    run(0, int64_t(parts.size()));
  std::vector<const void*> moved;
  for (tensor_view* v : views) moved.push_back(buf + at.at({v->data, v->nbytes}));
  for (size_t i = 0; i < views.size(); ++i) views[i]->data = moved[i];
  return copy;
}

}  // namespace tandem::cpu
