#include "kernels/backend/page_staging.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>

#include "kernels/base/error.h"

namespace tandem::backend {

staging_slots::staging_slots(int32_t capacity) {
  if (capacity < 0) throw tandem::error(fmt::format("staging slots: capacity {} is negative", capacity));
  held_.assign(size_t(capacity), false);
  for (int32_t s = capacity - 1; s >= 0; --s) free_.push_back(s);
}

std::optional<std::vector<int32_t>> staging_slots::acquire(int32_t n) {
  if (n < 0 || size_t(n) > free_.size()) {
    ++refused_;
    return std::nullopt;
  }
  std::vector<int32_t> out;
  out.reserve(size_t(n));
  for (int32_t i = 0; i < n; ++i) {
    out.push_back(free_.back());
    free_.pop_back();
    held_[size_t(out.back())] = true;
  }
  high_water_ = std::max(high_water_, in_use());
  return out;
}

void staging_slots::release(std::span<const int32_t> slots) {
  for (int32_t s : slots)
    if (s < 0 || s >= capacity() || !held_[size_t(s)])
      throw tandem::error(fmt::format("staging slots: slot {} is not held (capacity {})", s, capacity()));
  for (int32_t s : slots) {
    held_[size_t(s)] = false;
    free_.push_back(s);
  }
  // Lowest first again, so a transfer's slots stay as consecutive as the pool allows.
  std::sort(free_.begin(), free_.end(), std::greater<>());
}

page_stager::page_stager(staging_ops ops, int32_t n_buffers, size_t buffer_bytes)
    : ops_(std::move(ops)), buffer_bytes_(buffer_bytes) {
  if (!ops_.active() || !ops_.alloc_pinned || !ops_.wait)
    throw tandem::error("page stager: the device has no staging copies (alloc_pinned, copy_async, wait)");
  if (n_buffers <= 0 || buffer_bytes == 0)
    throw tandem::error(fmt::format("page stager: {} buffers of {} bytes; use at least one non-empty buffer",
                                    n_buffers, buffer_bytes));
  buffers_.resize(size_t(n_buffers));
  try {
    for (buffer& b : buffers_) b.host = ops_.alloc_pinned(buffer_bytes);
  } catch (...) {
    for (buffer& b : buffers_)
      if (b.host) ops_.free_pinned(b.host);
    throw;
  }
}

page_stager::~page_stager() {
  for (buffer& b : buffers_) {
    if (b.busy) ops_.wait(b.fence);
    if (b.host) ops_.free_pinned(b.host);
  }
}

int32_t page_stager::busy() const {
  return int32_t(std::count_if(buffers_.begin(), buffers_.end(), [](const buffer& b) { return b.busy; }));
}

void page_stager::finish(buffer& b) {
  if (!b.busy) return;
  ops_.wait(b.fence);
  if (b.drain_to) std::memcpy(b.drain_to, b.host, b.bytes);
  b.busy = false;
  b.drain_to = nullptr;
}

void page_stager::finish_all() {
  // The ring is filled in order from next_: the oldest busy buffer is next_ itself.
  for (size_t i = 0; i < buffers_.size(); ++i) finish(buffers_[(next_ + i) % buffers_.size()]);
}

page_stager::buffer& page_stager::next() {
  buffer& b = buffers_[next_];
  next_ = (next_ + 1) % buffers_.size();
  if (b.busy) {
    ++buffer_waits_;
    finish(b);
  }
  return b;
}

void page_stager::to_host(std::span<const page_copy> copies) {
  if (copies.empty()) return;
  if (ops_.quiesce) ops_.quiesce();  // the pages' KV writes are done before they are read
  try {
    for (const page_copy& c : copies)
      for (size_t off = 0; off < c.bytes; off += buffer_bytes_) {
        const size_t n = std::min(buffer_bytes_, c.bytes - off);
        buffer& b = next();
        b.fence = ops_.copy_async(b.host, static_cast<const uint8_t*>(c.src) + off, n);
        b.busy = true;
        b.drain_to = static_cast<uint8_t*>(c.dst) + off;
        b.bytes = n;
        ++copies_;
        bytes_ += int64_t(n);
      }
    finish_all();
  } catch (...) {
    // Leave no buffer busy: a later call must not drain a stale copy into its host page.
    for (buffer& b : buffers_) b.drain_to = nullptr;
    for (buffer& b : buffers_)
      if (b.busy) {
        b.busy = false;
        ops_.wait(b.fence);
      }
    throw;
  }
}

void page_stager::to_device(std::span<const page_copy> copies) {
  if (copies.empty()) return;
  if (ops_.quiesce) ops_.quiesce();  // no queued kernel still reads a page about to change
  try {
    for (const page_copy& c : copies)
      for (size_t off = 0; off < c.bytes; off += buffer_bytes_) {
        const size_t n = std::min(buffer_bytes_, c.bytes - off);
        buffer& b = next();
        std::memcpy(b.host, static_cast<const uint8_t*>(c.src) + off, n);
        b.fence = ops_.copy_async(static_cast<uint8_t*>(c.dst) + off, b.host, n);
        b.busy = true;
        b.drain_to = nullptr;
        b.bytes = n;
        ++copies_;
        bytes_ += int64_t(n);
      }
    finish_all();
  } catch (...) {
    for (buffer& b : buffers_)
      if (b.busy) {
        b.busy = false;
        ops_.wait(b.fence);
      }
    throw;
  }
}

}  // namespace tandem::backend
