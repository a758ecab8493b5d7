// The machine-ceiling probes of kernels/cpu/roofline.h: sane numbers and refusals (their
// values are timings, checked by `tandem bench model`, not here).
#include <doctest/doctest.h>

#include <cmath>

#include "kernels/base/error.h"
#include "kernels/cpu/roofline.h"
#include "kernels/cpu/thread_pool.h"

using namespace tandem;

TEST_CASE("roofline: the read probe gives a finite positive bandwidth for any thread count and size") {
  for (int32_t threads : {1, 2}) {
    cpu::thread_pool pool(threads);
    // 3 MiB: parts of whole f16 rows; 1 MiB + 320 bytes: parts that end mid-row, the last
    // ones shorter than a row (the matmul pass reads no row there).
    for (size_t bytes : {size_t(3) << 20, (size_t(1) << 20) + 320, size_t(256)}) {
      CAPTURE(threads);
      CAPTURE(bytes);
      const double bw = cpu::measure_read_bandwidth(pool, bytes, 1);
      CHECK(std::isfinite(bw));
      CHECK(bw > 0);
    }
  }
}

TEST_CASE("roofline: the read probe refuses a buffer under 256 bytes and zero repetitions") {
  cpu::thread_pool pool(1);
  CHECK_THROWS_AS(cpu::measure_read_bandwidth(pool, 255, 1), tandem::error);
  CHECK_THROWS_AS(cpu::measure_read_bandwidth(pool, size_t(1) << 20, 0), tandem::error);
}
