// GGUF reader/writer: the fixtures, round trips, and hostile input.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>

#include "kernels/gguf/gguf.h"
#include "kernels/gguf/half.h"

using namespace tandem;

namespace {

std::string fixture(const char* name) { return std::string(TANDEM_SHARED_MODELS) + "/" + name; }

std::string tmp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("tandem_test_gguf_" + std::to_string(::getpid()) + "_" + name)).string();
}

template <class T>
void put(std::vector<uint8_t>& b, T x) {
  const size_t at = b.size();
  b.resize(at + sizeof(T));
  std::memcpy(b.data() + at, &x, sizeof(T));
}
void put_str(std::vector<uint8_t>& b, const std::string& s) {
  put<uint64_t>(b, s.size());
  b.insert(b.end(), s.begin(), s.end());
}

std::string parse_error(const std::vector<uint8_t>& b, const gguf::parse_limits& lim = {}) {
  try {
    gguf::file::parse(b, lim, "test.gguf");
  } catch (const gguf::error& e) {
    return e.what();
  }
  return "";
}

gguf::writer small_writer() {
  gguf::writer w;
  w.set_string("general.architecture", "llama");
  w.set_u32("llama.block_count", 2);
  w.set_i32("some.i32", -7);
  w.set_u64("some.u64", 1ull << 40);
  w.set_f32("some.f32", 0.25f);
  w.set_bool("some.bool", true);
  w.set_array_string("some.strings", {"a", "", "ccc"});
  w.set_array_f32("some.floats", {1.5f, -2.0f});
  w.set_array_i32("some.ints", {3, -4, 5});
  std::vector<uint8_t> a(4 * 3 * 2);
  for (size_t i = 0; i < a.size(); ++i) a[i] = uint8_t(i);
  w.add_tensor("a", ggml_type::f32, {3, 2}, a);
  std::vector<uint8_t> q(34 * 2, 7);
  w.add_tensor("q", ggml_type::q8_0, {64}, q);
  w.add_tensor("h", ggml_type::f16, {5}, std::vector<uint8_t>(10, 1));
  return w;
}

}  // namespace

TEST_CASE("gguf: reads the f16 fixture") {
  auto f = gguf::file::open(fixture("r15m-f16.gguf"));
  CHECK(f.version() == 3);
  CHECK(f.alignment() == 32);
  CHECK(f.get_string("general.architecture") == "llama");
  CHECK(f.get_u32("llama.embedding_length") == 288);
  CHECK(f.get_u32("llama.block_count") == 6);
  CHECK(f.get_f32("llama.attention.layer_norm_rms_epsilon") == doctest::Approx(1e-5));
  CHECK(f.get_array("tokenizer.ggml.tokens").items.size() == 32000);
  CHECK(f.get_array("tokenizer.ggml.tokens").items[15043].as_string() == "\xE2\x96\x81Hello");
  CHECK(f.get_u64_or("no.such.key", 42) == 42);
  CHECK_THROWS_AS(f.get_u32("no.such.key"), gguf::error);
  CHECK_THROWS_AS(f.get_string("llama.block_count"), gguf::error);
  CHECK(f.tensors().size() == 56);
  const auto& e = f.tensor("token_embd.weight");
  CHECK(e.type == ggml_type::f16);
  CHECK(e.dims == std::vector<int64_t>{288, 32000});
  CHECK(e.nbytes == 288u * 32000u * 2u);
  auto v = e.view();
  CHECK(v.cols() == 288);
  CHECK(v.rows() == 32000);
  CHECK(f.tensor("blk.0.ffn_down.weight").dims == std::vector<int64_t>{768, 288});
  CHECK(f.tensor("blk.5.attn_norm.weight").type == ggml_type::f32);
  CHECK(f.find_tensor("output.weight") == nullptr);
  CHECK_THROWS_AS(f.tensor("output.weight"), gguf::error);
  // norms are plausible f32 numbers
  const float* n = static_cast<const float*>(f.tensor("output_norm.weight").data);
  for (int i = 0; i < 288; ++i) CHECK(std::isfinite(n[i]));
}

TEST_CASE("gguf: a truncated fixture names the tensor and the missing bytes") {
  std::vector<uint8_t> all;
  {
    std::FILE* fp = std::fopen(fixture("r15m-f16.gguf").c_str(), "rb");
    REQUIRE(fp != nullptr);
    all.resize(std::filesystem::file_size(fixture("r15m-f16.gguf")));
    REQUIRE(std::fread(all.data(), 1, all.size(), fp) == all.size());
    std::fclose(fp);
  }
  all.resize(all.size() - 1000);
  const std::string m = parse_error(all);
  CHECK(m.find("truncated at offset " + std::to_string(all.size())) != std::string::npos);
  CHECK(m.find("expected 1000 more bytes for tensor 'output_norm.weight'") != std::string::npos);
  all.resize(700000);  // inside the vocabulary
  CHECK(parse_error(all).find("truncated") != std::string::npos);
}

TEST_CASE("gguf: reads the q8_0 fixture") {
  auto f = gguf::file::open(fixture("r15m-q8_0.gguf"));
  const auto& q = f.tensor("blk.0.attn_q.weight");
  CHECK(q.type == ggml_type::q8_0);
  CHECK(q.nbytes == 288u / 32u * 34u * 288u);
  CHECK(q.view().type == ggml_type::q8_0);
}

TEST_CASE("gguf: writer round trip") {
  auto w = small_writer();
  auto bytes = w.bytes();
  auto f = gguf::file::parse(bytes);
  CHECK(f.version() == 3);
  CHECK(f.metadata().size() == 9);
  CHECK(f.metadata()[0].first == "general.architecture");
  CHECK(f.get_u32("llama.block_count") == 2);
  CHECK(f.find("some.i32")->as_i64() == -7);
  CHECK_THROWS_AS(f.get_u64("some.i32"), gguf::error);  // negative as unsigned
  CHECK(f.get_u64("some.u64") == (1ull << 40));
  CHECK_THROWS_AS(f.get_u32("some.u64"), gguf::error);  // does not fit
  CHECK(f.get_f32("some.f32") == 0.25f);
  CHECK(f.find("some.bool")->as_bool());
  CHECK(f.get_array("some.strings").items[2].as_string() == "ccc");
  CHECK(f.get_array("some.strings").items[1].as_string().empty());
  CHECK(f.get_array("some.floats").items[1].as_f64() == -2.0);
  CHECK(f.get_array("some.ints").elem_type == gguf::value_type::i32);
  CHECK(f.get_array("some.ints").items[1].as_i64() == -4);
  REQUIRE(f.tensors().size() == 3);
  for (auto& t : f.tensors()) {
    CHECK(t.offset % 32 == 0);
    CHECK((static_cast<const uint8_t*>(t.data) - bytes.data()) % 32 == 0);
  }
  const auto& a = f.tensor("a");
  CHECK(a.dims == std::vector<int64_t>{3, 2});
  CHECK(static_cast<const uint8_t*>(a.data)[23] == 23);
  CHECK(f.tensor("q").nbytes == 68);
  CHECK(f.tensor("h").offset == 128);  // 24 -> 32, +68 -> 128
  CHECK(static_cast<const uint8_t*>(f.tensor("h").data)[9] == 1);

  // write() produces the same bytes as bytes(), and open() reads it back
  const std::string p = tmp_path("rt.gguf");
  w.write(p);
  {
    auto g = gguf::file::open(p);
    CHECK(g.tensors().size() == 3);
    CHECK(std::filesystem::file_size(p) == bytes.size());
    CHECK(std::memcmp(g.tensor("h").data, f.tensor("h").data, 10) == 0);
  }
  std::filesystem::remove(p);
}

TEST_CASE("gguf: writer layout matches llama.cpp's gguf writer byte for byte") {
  // Layout of gguf_write_to_buf: magic, version 3, n_tensors, n_kv, kvs, tensor infos,
  // zero padding to the alignment, each tensor padded to the alignment.
  gguf::writer w;
  w.set_u32("k", 5);
  w.add_tensor("t", ggml_type::f32, {2}, std::vector<uint8_t>(8, 0xAB));
  std::vector<uint8_t> want;
  want.insert(want.end(), {'G', 'G', 'U', 'F'});
  put<uint32_t>(want, 3);
  put<uint64_t>(want, 1);
  put<uint64_t>(want, 1);
  put_str(want, "k");
  put<uint32_t>(want, 4);
  put<uint32_t>(want, 5);
  put_str(want, "t");
  put<uint32_t>(want, 1);
  put<uint64_t>(want, 2);
  put<uint32_t>(want, 0);
  put<uint64_t>(want, 0);
  want.resize(96, 0);  // 75 bytes of header -> 96
  want.insert(want.end(), 8, 0xAB);
  want.resize(128, 0);
  CHECK(w.bytes() == want);
}

TEST_CASE("gguf: writer rejects bad tensors") {
  gguf::writer w;
  CHECK_THROWS_AS(w.add_tensor("x", ggml_type::f32, {3}, std::vector<uint8_t>(11)), tandem::error);
  CHECK_THROWS_AS(w.add_tensor("x", ggml_type::q8_0, {31}, std::vector<uint8_t>(34)), tandem::error);
  CHECK_THROWS_AS(w.add_tensor("x", ggml_type::f32, {0}, {}), tandem::error);
  CHECK_THROWS_AS(w.add_tensor(std::string(64, 'n'), ggml_type::f32, {1}, std::vector<uint8_t>(4)), tandem::error);
  w.add_tensor("x", ggml_type::f32, {1}, std::vector<uint8_t>(4));
  CHECK_THROWS_AS(w.add_tensor("x", ggml_type::f32, {1}, std::vector<uint8_t>(4)), tandem::error);
  CHECK_THROWS_AS(w.write("/nonexistent-dir/x.gguf"), tandem::error);
}

TEST_CASE("gguf: nested arrays, v2, custom alignment and other tensor types") {
  gguf::writer w;
  auto inner = std::make_shared<gguf::array_value>();
  inner->elem_type = gguf::value_type::u8;
  for (int i = 0; i < 3; ++i) {
    gguf::value x;
    x.type = gguf::value_type::u8;
    x.v = uint64_t(i);
    inner->items.push_back(x);
  }
  auto outer = std::make_shared<gguf::array_value>();
  outer->elem_type = gguf::value_type::array;
  gguf::value iv;
  iv.type = gguf::value_type::array;
  iv.v = inner;
  outer->items = {iv, iv};
  gguf::value ov;
  ov.type = gguf::value_type::array;
  ov.v = outer;
  w.set_value("nested", ov);
  w.set_u32("general.alignment", 64);
  w.add_tensor("a", ggml_type::f32, {1}, std::vector<uint8_t>(4));
  // q2_K (type 10): 256 elements per 84-byte block; parses but cannot be viewed.
  w.add_tensor("k", ggml_type(10), {256, 2}, std::vector<uint8_t>(168));
  auto b = w.bytes();
  auto f = gguf::file::parse(b);
  CHECK(f.alignment() == 64);
  CHECK(f.tensor("k").offset == 64);
  CHECK(f.get_array("nested").items[1].as_array().items[2].as_u64() == 2);
  try {
    (void)f.tensor("k").view();
    FAIL("view of q2_K must throw");
  } catch (const tandem::error& e) {
    CHECK(e.kind() == error_kind::unimplemented);
    CHECK(std::string(e.what()).find("q2_K") != std::string::npos);
  }
  // depth limit
  gguf::parse_limits lim;
  lim.max_array_depth = 1;
  CHECK(parse_error(b, lim).find("nests arrays deeper") != std::string::npos);
  // the same bytes as version 2 are accepted
  b[4] = 2;
  CHECK(gguf::file::parse(b).version() == 2);
}

TEST_CASE("gguf: rejects malformed files with a useful message") {
  auto good = small_writer().bytes();
  CHECK(parse_error(good).empty());

  auto b = good;
  b[0] = 'X';
  CHECK(parse_error(b).find("not a GGUF file") != std::string::npos);
  b = good;
  b[4] = 1;
  CHECK(parse_error(b).find("version 1") != std::string::npos);
  b = good;
  b[4] = 0;
  b[7] = 3;
  CHECK(parse_error(b).find("big-endian") != std::string::npos);

  // truncated in the middle of the data of the last tensor
  b.assign(good.begin(), good.end() - 30);
  const std::string m = parse_error(b);
  CHECK(m.find("test.gguf") != std::string::npos);
  CHECK(m.find("truncated at offset " + std::to_string(b.size())) != std::string::npos);
  CHECK(m.find("tensor 'h'") != std::string::npos);
  CHECK(m.find("re-download") != std::string::npos);

  // every truncation point fails cleanly (never crashes, never succeeds)
  for (size_t n = 0; n < good.size() - 22; ++n) {
    b.assign(good.begin(), good.begin() + long(n));
    CHECK_MESSAGE(!parse_error(b).empty(), "prefix of " << n << " bytes parsed");
  }

  // huge counts and lengths are rejected before allocating
  b = good;
  std::memset(b.data() + 16, 0xFF, 8);  // n_kv
  CHECK(parse_error(b).find("metadata entries") != std::string::npos);
  b = good;
  std::memset(b.data() + 24, 0xFF, 8);  // length of the first key
  CHECK(!parse_error(b).empty());
}

TEST_CASE("gguf: rejects bad tensor infos") {
  // Build by hand: one tensor with configurable fields.
  auto make = [](uint32_t nd, std::vector<uint64_t> dims, uint32_t type, uint64_t off, size_t data_bytes) {
    std::vector<uint8_t> b;
    b.insert(b.end(), {'G', 'G', 'U', 'F'});
    put<uint32_t>(b, 3);
    put<uint64_t>(b, 1);
    put<uint64_t>(b, 0);
    put_str(b, "t");
    put<uint32_t>(b, nd);
    for (auto d : dims) put<uint64_t>(b, d);
    put<uint32_t>(b, type);
    put<uint64_t>(b, off);
    b.resize((b.size() + 31) / 32 * 32, 0);
    b.resize(b.size() + data_bytes, 0);
    return b;
  };
  CHECK(parse_error(make(2, {4, 2}, 0, 0, 32)).empty());
  CHECK(parse_error(make(5, {1, 1, 1, 1, 1}, 0, 0, 32)).find("dimensions") != std::string::npos);
  CHECK(parse_error(make(2, {4, 0}, 0, 0, 32)).find("invalid dimension 0") != std::string::npos);
  CHECK(parse_error(make(2, {1ull << 62, 1ull << 62}, 0, 0, 32)).find("overflows") != std::string::npos);
  CHECK(parse_error(make(2, {1ull << 40, 1ull << 20}, 0, 0, 32)).find("larger than the file") != std::string::npos);
  CHECK(parse_error(make(2, {4, 2}, 0, 4, 64)).find("not a multiple of the alignment") != std::string::npos);
  CHECK(parse_error(make(2, {4, 2}, 0, 32, 32)).find("truncated") != std::string::npos);
  CHECK(parse_error(make(2, {4, 2}, 0, 0, 31)).find("tensor 't'") != std::string::npos);
  CHECK(parse_error(make(1, {33}, 8, 0, 68)).find("block size") != std::string::npos);
  CHECK(parse_error(make(1, {4}, 99, 0, 32)).find("unknown tensor type 99") != std::string::npos);
}

TEST_CASE("gguf: random mutations never crash the parser") {
  auto good = small_writer().bytes();
  std::mt19937 rng(1234);
  int accepted = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    auto b = good;
    const int flips = 1 + int(rng() % 8);
    for (int k = 0; k < flips; ++k) {
      const size_t at = rng() % b.size();
      switch (rng() % 3) {
        case 0: b[at] = uint8_t(rng()); break;
        case 1: b[at] = 0xFF; break;
        default: b[at] ^= uint8_t(1u << (rng() % 8)); break;
      }
    }
    if (rng() % 4 == 0) b.resize(rng() % b.size());
    try {
      auto f = gguf::file::parse(b);
      ++accepted;
      for (auto& t : f.tensors()) {
        // accepted tensors lie inside the buffer
        const auto* p = static_cast<const uint8_t*>(t.data);
        REQUIRE(p >= b.data());
        REQUIRE(p + t.nbytes <= b.data() + b.size());
      }
    } catch (const gguf::error&) {
    }
  }
  CHECK(accepted > 0);  // some mutations hit only data bytes
}

TEST_CASE("gguf: half and bfloat16 conversions") {
  using namespace tandem::gguf;
  CHECK(fp32_to_fp16(1.0f) == 0x3C00);
  CHECK(fp32_to_fp16(-2.0f) == 0xC000);
  CHECK(fp32_to_fp16(65504.0f) == 0x7BFF);
  CHECK(fp32_to_fp16(65520.0f) == 0x7C00);
  CHECK(fp32_to_fp16(1e-8f) == 0x0000);
  CHECK(fp32_to_fp16(5.960464477539063e-08f) == 0x0001);
  CHECK(fp16_to_fp32(0x0001) == 5.960464477539063e-08f);
  CHECK(std::isnan(fp16_to_fp32(fp32_to_fp16(NAN))));
  CHECK(fp32_to_bf16(1.0f) == 0x3F80);
  CHECK(bf16_to_fp32(0x3F80) == 1.0f);
  // every half round-trips exactly through fp32
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = fp16_to_fp32(uint16_t(h));
    if (std::isnan(f)) continue;
    REQUIRE(fp32_to_fp16(f) == h);
  }
  // rounding to nearest even between two halves
  const float a = fp16_to_fp32(0x3C00), b = fp16_to_fp32(0x3C01);
  CHECK(fp32_to_fp16((a + b) / 2) == 0x3C00);
  CHECK(fp32_to_fp16(std::nextafter((a + b) / 2, 2.0f)) == 0x3C01);
}
