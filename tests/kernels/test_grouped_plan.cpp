// The CUDA backend's grouped quantized matmul plan (kernels/backend/cuda/grouped_plan.h): one
// quantize per distinct input and group size, work items numbered per weight type, scratch
// areas aligned and disjoint. The kernels it feeds are checked on a GPU (tests/gpu).
#include <doctest/doctest.h>

#include <algorithm>
#include <vector>

#include "kernels/backend/cuda/grouped_plan.h"

using namespace tandem::cuda_backend;

TEST_CASE("grouped plan: shared inputs quantize once, items are numbered per type") {
  std::vector<float> a(64 * 512), b(64 * 512);
  constexpr uint32_t q4_K = 12, q8_0 = 8, q6_K = 14;
  const std::vector<quant_job> jobs = {
      {.x = a.data(), .rows = 2, .k = 512, .n = 96, .type = q4_K, .group = 256},  // gate of expert 0
      {.x = a.data(), .rows = 2, .k = 512, .n = 96, .type = q4_K, .group = 256},  // up of expert 0: same x
      {.x = b.data(), .rows = 3, .k = 512, .n = 64, .type = q8_0, .group = 32},
      {.x = a.data(), .rows = 1, .k = 512, .n = 96, .type = q4_K, .group = 256},  // other rows: its own input
      {.x = b.data(), .rows = 3, .k = 512, .n = 32, .type = q6_K, .group = 256},
  };
  const grouped_quant_plan p = plan_grouped_quant(jobs);
  REQUIRE(p.inputs[0].size() == 1);
  REQUIRE(p.inputs[1].size() == 3);
  CHECK(p.blocks[0] == 3 * 512 / 32);
  CHECK(p.inputs[1][0].first == 0);
  CHECK(p.inputs[1][1].first == 2 * 2);
  CHECK(p.inputs[1][2].first == 2 * 2 + 1 * 2);
  CHECK(p.blocks[1] == 2 * 2 + 1 * 2 + 3 * 2);
  REQUIRE(p.types.size() == 3);
  CHECK(p.types[0].type == q4_K);
  REQUIRE(p.types[0].jobs.size() == 3);
  CHECK(p.types[0].jobs[0].input == 0);
  CHECK(p.types[0].jobs[1].input == 0);
  CHECK(p.types[0].jobs[2].input == 1);
  CHECK(p.types[0].jobs[1].first == 96 * 2);
  CHECK(p.types[0].jobs[2].first == 96 * 4);
  CHECK(p.types[0].items == 96 * 5);
  CHECK(p.types[1].type == q8_0);
  CHECK(p.types[1].items == 64 * 3);
  CHECK(p.types[2].jobs[0].input == 2);
  // Every area 16-byte aligned, disjoint, inside the total.
  struct area {
    size_t at, bytes;
  };
  std::vector<area> areas;
  for (const auto& in : p.inputs)
    for (const planned_input& i : in) {
      areas.push_back({i.qs_at, size_t(i.rows * i.k)});
      areas.push_back({i.d_at, size_t(i.rows * (i.k / i.group)) * 4});
      areas.push_back({i.sums_at, size_t(i.rows * (i.k / 32)) * 2});
    }
  std::sort(areas.begin(), areas.end(), [](const area& x, const area& y) { return x.at < y.at; });
  for (size_t i = 0; i < areas.size(); ++i) {
    CHECK(areas[i].at % 16 == 0);
    if (i + 1 < areas.size()) CHECK(areas[i].at + areas[i].bytes <= areas[i + 1].at);
    CHECK(areas[i].at + areas[i].bytes <= p.bytes);
  }
  CHECK(plan_grouped_quant({}).types.empty());
}
