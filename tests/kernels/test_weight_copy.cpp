// The in-memory weight copy (kernels/cpu/weight_copy.h): the copied views hold the same bytes
// on cache-line boundaries, shared bytes are copied once, the RAM check's count matches what
// is taken, and matmuls on the copy give the bits of the file's bytes.
#include <doctest/doctest.h>

#include <cstring>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/quant_packed.h"
#include "kernels/cpu/quant_ref.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cpu/weight_copy.h"
#include "tests/kernels/matmul_fixtures.h"

using namespace tandem;
using namespace tandem::test;

namespace {

std::vector<uint8_t> f16_bytes(int64_t rows, int64_t cols, uint64_t seed) {
  const auto x = random_floats(size_t(rows * cols), seed);
  std::vector<uint8_t> b(size_t(rows * cols) * 2);
  auto* h = reinterpret_cast<uint16_t*>(b.data());
  for (size_t i = 0; i < x.size(); ++i) h[i] = cpu::fp32_to_fp16(x[i]);
  return b;
}

}  // namespace

TEST_CASE("weight copy: same bytes, aligned, shared bytes copied once") {
  const auto a = f16_bytes(40, 96, 1);
  const auto b = cpu::quantize_rows(ggml_type::q8_0, random_floats(17 * 64, 2).data(), 17, 64);
  std::vector<tensor_view> views = {view_of(ggml_type::f16, a, 40, 96), view_of(ggml_type::q8_0, b, 17, 64),
                                    view_of(ggml_type::f16, a, 40, 96)};
  const std::vector<tensor_view> before = views;
  // 7680 bytes, then 17 x 68 = 1156 rounded up to 1216; the third shares the first's copy.
  CHECK(cpu::weight_copy_bytes(views) == 7680 + 1216);
  std::vector<tensor_view*> ptrs = {&views[0], &views[1], &views[2]};
  cpu::thread_pool pool(2);
  const auto copy = cpu::copy_weights(ptrs, &pool);
  REQUIRE(copy != nullptr);
  for (size_t i = 0; i < views.size(); ++i) {
    CAPTURE(i);
    CHECK(views[i].data != before[i].data);
    CHECK(reinterpret_cast<uintptr_t>(views[i].data) % 64 == 0);
    CHECK(views[i].nbytes == before[i].nbytes);
    CHECK(std::memcmp(views[i].data, before[i].data, views[i].nbytes) == 0);
  }
  CHECK(views[2].data == views[0].data);
  CHECK(static_cast<const uint8_t*>(views[1].data) == copy.get() + 7680);
  CHECK(cpu::copy_weights({}, &pool) == nullptr);
}

TEST_CASE("weight copy: pack_weights copies what it does not pack, and the matmuls keep their bits") {
  const auto f = f16_bytes(72, 128, 3);
  const auto q8 = cpu::quantize_rows(ggml_type::q8_0, random_floats(72 * 128, 4).data(), 72, 128);
  const auto q4 = cpu::quantize_rows(ggml_type::q4_0, random_floats(72 * 128, 5).data(), 72, 128);
  const std::vector<tensor_view> views = {view_of(ggml_type::f16, f, 72, 128), view_of(ggml_type::q8_0, q8, 72, 128),
                                          view_of(ggml_type::q4_0, q4, 72, 128)};
  cpu::thread_pool pool(2);
  const auto plain = cpu::pack_weights(views, cpu_isa::best, &pool, {.pack_low_bit = true, .copy_rest = false});
  const auto copied = cpu::pack_weights(views, cpu_isa::best, &pool, {.pack_low_bit = true, .copy_rest = true});
  const bool q4_packed = cpu::packs(ggml_type::q4_0) && cpu::resolve_isa(cpu_isa::best) != cpu_isa::avx2;
  for (size_t i = 0; i < views.size(); ++i) {
    CAPTURE(i);
    CHECK(plain[i].copy == nullptr);
    CHECK(plain[i].view.data == views[i].data);
    const bool taken = !(i == 2 && q4_packed) && copied[i].amx == nullptr;
    CHECK((copied[i].copy != nullptr) == taken);
    CHECK((copied[i].view.data != views[i].data) == taken);
    for (int64_t batch : {int64_t(1), int64_t(3), int64_t(9)}) {
      CAPTURE(batch);
      const auto x = random_floats(size_t(batch * 128), uint64_t(10 + batch));
      std::vector<float> y0(size_t(batch * 72)), y1(y0.size()), scratch;
      cpu::matmul(plain[i], x.data(), batch, y0.data(), scratch, &pool);
      cpu::matmul(copied[i], x.data(), batch, y1.data(), scratch, &pool);
      CHECK(std::memcmp(y0.data(), y1.data(), y0.size() * sizeof(float)) == 0);
    }
  }
}
