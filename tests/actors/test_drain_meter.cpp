// The prefill drain rate the router's queue-wait estimate divides by (drain_meter.h), on a
// made-up timeline: it measures only time with requests waiting, counts short stretches as
// well as long ones, and reports nothing before a queue was seen.
#include <doctest/doctest.h>

#include "actors/prefill_scheduler/drain_meter.h"

using namespace tandem;
using st = drain_meter::state;

TEST_CASE("drain_meter: lone prompts with idle gaps report no drain rate (no queue seen), only a busy rate") {
  drain_meter m(100, 0.3);
  int64_t t = 0;
  for (int i = 0; i < 50; ++i) {
    m.observe(t, st::busy, 0);       // a prompt arrives, is prefilled alone ...
    m.observe(t + 30, st::idle, 32);  // ... in 30 ms, then nothing for 20 ms
    t += 50;
  }
  CHECK(m.tokens_per_s() == 0);
  CHECK(m.busy_tokens_per_s() == doctest::Approx(32.0 * 1000 / 30).epsilon(0.01));
}

TEST_CASE("drain_meter: the rate while requests wait, short stretches summed without bias") {
  drain_meter m(100, 0.3);
  // 400 queued stretches of 1 ms alternating with 1 ms idle: each computes 10 tokens.
  int64_t t = 0;
  for (int i = 0; i < 400; ++i) {
    m.observe(t, st::queued, 0);
    m.observe(t + 1, st::idle, 10);
    t += 2;
  }
  CHECK(m.queued_tokens_per_s() == doctest::Approx(10000.0).epsilon(0.01));
  // A long queue that drains at 4000 tokens/s: the average moves there (smoothly).
  for (int i = 0; i < 200; ++i) {
    m.observe(t, st::queued, 0);
    m.observe(t + 10, st::queued, 40);
    t += 10;
  }
  CHECK(m.tokens_per_s() == doctest::Approx(4000.0).epsilon(0.02));
  // Time without work never counts: a long idle stretch leaves the rate alone.
  m.observe(t, st::idle, 0);
  m.observe(t + 100000, st::idle, 0);
  CHECK(m.tokens_per_s() == doctest::Approx(4000.0).epsilon(0.02));
}

TEST_CASE("drain_meter: the first sample comes after a fifth of the window, later ones smooth") {
  drain_meter m(100, 0.5);
  m.observe(0, st::queued, 0);
  m.observe(19, st::queued, 100);
  CHECK(m.tokens_per_s() == 0);
  m.observe(20, st::queued, 100);  // 200 tokens in 20 ms
  CHECK(m.tokens_per_s() == doctest::Approx(10000.0));
  m.observe(120, st::queued, 100);  // 1000 tokens/s over the next 100 ms: halfway there
  CHECK(m.tokens_per_s() == doctest::Approx(5500.0));
}

TEST_CASE("drain_meter: a batch's tokens are spread over the time it ran, not credited to the state it ended in") {
  // Batches of 240 tokens take 40 ms (6000 tokens/s); a request arrives 35 ms into each and
  // waits 5 ms for the next. Crediting each lump to the 5 queued milliseconds read 48000.
  drain_meter m(100, 0.3);
  int64_t t = 0;
  m.observe(t, st::busy, 0);
  for (int i = 0; i < 100; ++i) {
    m.observe(t + 35, st::queued, 0);
    m.observe(t + 40, st::busy, 240);
    t += 40;
  }
  CHECK(m.tokens_per_s() == doctest::Approx(6000.0).epsilon(0.01));
  CHECK(m.busy_tokens_per_s() == doctest::Approx(6000.0).epsilon(0.01));
}

TEST_CASE("drain_meter: a drain that slows down is reported before its window closes") {
  drain_meter m(100, 0.3);
  int64_t t = 0;
  // A steady queue at 20000 tokens/s (decode idle) ...
  for (int i = 0; i < 50; ++i) {
    m.observe(t, st::queued, 0);
    m.observe(t + 10, st::queued, 200);
    t += 10;
  }
  CHECK(m.tokens_per_s() == doctest::Approx(20000.0).epsilon(0.01));
  // ... then the worker is shared with a full decode batch: 5000 tokens/s. The window that
  // closes 20 ms into it moves the average little (17000 of it); 60 ms later, the open
  // window's 5000 is reported already (the next close would be 40 ms later still).
  for (int i = 0; i < 8; ++i) {
    m.observe(t + 10, st::queued, 50);
    t += 10;
  }
  CHECK(m.tokens_per_s() == doctest::Approx(5000.0).epsilon(0.01));
}

TEST_CASE("drain_state: tokens beyond one forward step count as a queue, also once admitted to the batch") {
  // Three prompts of 80 tokens fit one step of 256: the scheduler is busy, not queued.
  CHECK(drain_state(false, 240, true, 256) == st::busy);
  // A fourth is admitted to the batch (up to 8 requests) but waits for the next step: queued,
  // though the scheduler's queue is empty (short prompts in a burst never fill it).
  CHECK(drain_state(false, 320, true, 256) == st::queued);
  CHECK(drain_state(true, 10, true, 256) == st::queued);  // a request in the queue
  CHECK(drain_state(false, 0, false, 256) == st::idle);
  CHECK(drain_state(false, 0, true, 256) == st::busy);  // acquiring pages, nothing to compute yet
}

TEST_CASE("drain_meter: a queued rate left from a burst goes stale after 10 windows of work without a queue") {
  drain_meter m(100, 0.3);
  int64_t t = 0;
  // A burst: the queue drains at 1000 tokens/s (decode holds most of the worker).
  for (int i = 0; i < 100; ++i) {
    m.observe(t, st::queued, 0);
    m.observe(t + 10, st::queued, 10);
    t += 10;
  }
  CHECK(m.tokens_per_s() == doctest::Approx(1000.0).epsilon(0.02));
  // Normal load after it: lone prompts prefilled at 4000 tokens/s, no queue.
  auto lone = [&](int n) {
    for (int i = 0; i < n; ++i) {
      m.observe(t, st::busy, 0);
      m.observe(t + 10, st::idle, 40);
      m.observe(t + 20, st::idle, 0);  // idle time does not age the rate
      t += 20;
    }
  };
  lone(90);  // 900 ms of work: not stale yet
  CHECK(m.tokens_per_s() == doctest::Approx(1000.0).epsilon(0.02));
  lone(20);  // past 1000 ms of work without a queue: the busy rate as it is now
  CHECK(m.tokens_per_s() == doctest::Approx(4000.0).epsilon(0.02));
  CHECK(m.queued_tokens_per_s() == doctest::Approx(1000.0).epsilon(0.02));
  // A queue forms again: its estimate starts from the busy rate, then follows its own samples.
  m.observe(t, st::queued, 0);
  CHECK(m.tokens_per_s() == doctest::Approx(4000.0).epsilon(0.02));
  for (int i = 0; i < 200; ++i) {
    m.observe(t + 10, st::queued, 20);  // 2000 tokens/s
    t += 10;
  }
  CHECK(m.tokens_per_s() == doctest::Approx(2000.0).epsilon(0.02));
}
