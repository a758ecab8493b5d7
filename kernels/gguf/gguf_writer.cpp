// GGUF writer (v3): metadata and tensors in the order they were added, tensor data aligned as
// the file's general.alignment says.
#include <cstring>

#include "kernels/gguf/gguf.h"
#include "kernels/gguf/gguf_format.h"
#include "kernels/gguf/type_traits.h"

namespace tandem::gguf {

using namespace format;

// ---------------------------------------------------------------------------------------------
// writer

namespace {

value make_scalar(value_type t, uint64_t u) { value v; v.type = t; v.v = u; return v; }
value make_signed(value_type t, int64_t i) { value v; v.type = t; v.v = i; return v; }

class byte_sink {
 public:
  explicit byte_sink(std::vector<uint8_t>& out) : out_(out) {}
  template <class T>
  void put(T x) {
    const size_t at = out_.size();
    out_.resize(at + sizeof(T));
    std::memcpy(out_.data() + at, &x, sizeof(T));
  }
  void str(const std::string& s) {
    put<uint64_t>(s.size());
    out_.insert(out_.end(), s.begin(), s.end());
  }
  void val(const value& v) {
    switch (v.type) {
      case value_type::u8: put<uint8_t>(uint8_t(v.as_u64())); break;
      case value_type::i8: put<int8_t>(int8_t(v.as_i64())); break;
      case value_type::u16: put<uint16_t>(uint16_t(v.as_u64())); break;
      case value_type::i16: put<int16_t>(int16_t(v.as_i64())); break;
      case value_type::u32: put<uint32_t>(uint32_t(v.as_u64())); break;
      case value_type::i32: put<int32_t>(int32_t(v.as_i64())); break;
      case value_type::u64: put<uint64_t>(v.as_u64()); break;
      case value_type::i64: put<int64_t>(v.as_i64()); break;
      case value_type::f32: put<float>(float(v.as_f64())); break;
      case value_type::f64: put<double>(v.as_f64()); break;
      case value_type::boolean: put<uint8_t>(v.as_bool() ? 1 : 0); break;
      case value_type::string: str(v.as_string()); break;
      case value_type::array: {
        const array_value& a = v.as_array();
        put<uint32_t>(uint32_t(a.elem_type));
        put<uint64_t>(a.items.size());
        for (auto& it : a.items) {
          if (it.type != a.elem_type)
            throw tandem::error("gguf::writer: array item of type " + value_type_name(it.type) +
                                " in an array of " + value_type_name(a.elem_type) + ": build uniform arrays");
          val(it);
        }
        break;
      }
    }
  }

 private:
  std::vector<uint8_t>& out_;
};

}  // namespace

void writer::set_value(const std::string& key, value v) {
  if (key == "general.alignment") {
    const uint64_t a = v.type == value_type::u32 ? v.as_u64() : 0;
    if (a == 0 || (a & (a - 1)) != 0)
      throw tandem::error("gguf::writer: general.alignment must be a u32 power of two");
    alignment_ = a;
  }
  for (auto& e : kv_) {
    if (e.key == key) {
      e.val = std::move(v);
      return;
    }
  }
  kv_.push_back({key, std::move(v)});
}

void writer::set_u32(const std::string& key, uint32_t v) { set_value(key, make_scalar(value_type::u32, v)); }
void writer::set_i32(const std::string& key, int32_t v) { set_value(key, make_signed(value_type::i32, v)); }
void writer::set_u64(const std::string& key, uint64_t v) { set_value(key, make_scalar(value_type::u64, v)); }
void writer::set_f32(const std::string& key, float v) {
  value x; x.type = value_type::f32; x.v = double(v);
  set_value(key, std::move(x));
}
void writer::set_bool(const std::string& key, bool v) {
  value x; x.type = value_type::boolean; x.v = v;
  set_value(key, std::move(x));
}
void writer::set_string(const std::string& key, const std::string& v) {
  value x; x.type = value_type::string; x.v = v;
  set_value(key, std::move(x));
}
void writer::set_array_string(const std::string& key, const std::vector<std::string>& v) {
  auto a = std::make_shared<array_value>();
  a->elem_type = value_type::string;
  a->items.reserve(v.size());
  for (auto& s : v) {
    value x; x.type = value_type::string; x.v = s;
    a->items.push_back(std::move(x));
  }
  value x; x.type = value_type::array; x.v = std::move(a);
  set_value(key, std::move(x));
}
void writer::set_array_f32(const std::string& key, const std::vector<float>& v) {
  auto a = std::make_shared<array_value>();
  a->elem_type = value_type::f32;
  a->items.reserve(v.size());
  for (float f : v) {
    value x; x.type = value_type::f32; x.v = double(f);
    a->items.push_back(std::move(x));
  }
  value x; x.type = value_type::array; x.v = std::move(a);
  set_value(key, std::move(x));
}
void writer::set_array_i32(const std::string& key, const std::vector<int32_t>& v) {
  auto a = std::make_shared<array_value>();
  a->elem_type = value_type::i32;
  a->items.reserve(v.size());
  for (int32_t i : v) a->items.push_back(make_signed(value_type::i32, i));
  value x; x.type = value_type::array; x.v = std::move(a);
  set_value(key, std::move(x));
}

void writer::add_tensor(const std::string& name, ggml_type type, std::vector<int64_t> dims,
                        std::vector<uint8_t> data) {
  const std::string what = "gguf::writer: tensor '" + name + "'";
  // ggml keeps names in a 64-byte buffer (GGML_MAX_NAME) including the terminator.
  if (name.empty() || name.size() >= 64) throw tandem::error(what + ": the name must be 1..63 bytes");
  for (auto& t : tensors_)
    if (t.name == name) throw tandem::error(what + " was added twice: use unique tensor names");
  if (dims.empty() || dims.size() > 4) throw tandem::error(what + ": needs 1..4 dimensions");
  const type_traits tt = traits(uint32_t(type));
  if (tt.block_size == 0) throw tandem::error(what + ": unknown type " + std::to_string(uint32_t(type)));
  uint64_t rows = 1;
  for (size_t i = 0; i < dims.size(); ++i) {
    if (dims[i] <= 0) throw tandem::error(what + ": dimension " + std::to_string(dims[i]) + " must be positive");
    if (i > 0) rows *= uint64_t(dims[i]);
  }
  if (dims[0] % tt.block_size != 0)
    throw tandem::error(what + ": row length " + std::to_string(dims[0]) + " is not a multiple of the " +
                        std::string(tt.name) + " block size " + std::to_string(tt.block_size));
  const uint64_t need = uint64_t(dims[0] / tt.block_size) * tt.type_size * rows;
  if (data.size() != need)
    throw tandem::error(what + ": has " + std::to_string(data.size()) + " bytes of data, expected " +
                        std::to_string(need));
  tensors_.push_back({name, type, std::move(dims), std::move(data)});
}

namespace {
/// Header (kv + tensor infos + padding up to the data section) of a writer's file.
std::vector<uint8_t> header_bytes(const std::vector<std::pair<std::string, const value*>>& kv,
                                  const std::vector<std::tuple<const std::string*, ggml_type, const std::vector<int64_t>*, uint64_t>>& ti,
                                  uint64_t alignment) {
  std::vector<uint8_t> out;
  byte_sink s(out);
  s.put<uint32_t>(gguf_magic);
  s.put<uint32_t>(3);
  s.put<uint64_t>(ti.size());
  s.put<uint64_t>(kv.size());
  for (auto& [k, v] : kv) {
    s.str(k);
    s.put<uint32_t>(uint32_t(v->type));
    s.val(*v);
  }
  for (auto& [name, type, dims, off] : ti) {
    s.str(*name);
    s.put<uint32_t>(uint32_t(dims->size()));
    for (int64_t d : *dims) s.put<uint64_t>(uint64_t(d));
    s.put<uint32_t>(uint32_t(type));
    s.put<uint64_t>(off);
  }
  out.resize(align_up(out.size(), alignment), 0);
  return out;
}
}  // namespace

std::vector<uint8_t> writer::bytes() const {
  std::vector<std::pair<std::string, const value*>> kv;
  for (auto& e : kv_) kv.emplace_back(e.key, &e.val);
  std::vector<std::tuple<const std::string*, ggml_type, const std::vector<int64_t>*, uint64_t>> ti;
  uint64_t off = 0;
  for (auto& t : tensors_) {
    ti.emplace_back(&t.name, t.type, &t.dims, off);
    off = align_up(off + t.data.size(), alignment_);
  }
  std::vector<uint8_t> out = header_bytes(kv, ti, alignment_);
  const size_t data_start = out.size();
  out.reserve(data_start + off);
  for (size_t i = 0; i < tensors_.size(); ++i) {
    out.resize(data_start + std::get<3>(ti[i]), 0);
    out.insert(out.end(), tensors_[i].data.begin(), tensors_[i].data.end());
  }
  out.resize(data_start + off, 0);
  return out;
}

void writer::write(const std::string& path) const {
  std::vector<std::pair<std::string, const value*>> kv;
  for (auto& e : kv_) kv.emplace_back(e.key, &e.val);
  std::vector<std::tuple<const std::string*, ggml_type, const std::vector<int64_t>*, uint64_t>> ti;
  uint64_t off = 0;
  for (auto& t : tensors_) {
    ti.emplace_back(&t.name, t.type, &t.dims, off);
    off = align_up(off + t.data.size(), alignment_);
  }
  const std::vector<uint8_t> header = header_bytes(kv, ti, alignment_);
  std::FILE* fp = std::fopen(path.c_str(), "wb");
  if (fp == nullptr)
    throw tandem::error("cannot create " + path + ": " + std::strerror(errno) + ": check the directory and permissions");
  bool ok = std::fwrite(header.data(), 1, header.size(), fp) == header.size();
  static const uint8_t zeros[256] = {};
  uint64_t written = 0;
  for (size_t i = 0; ok && i < tensors_.size(); ++i) {
    const auto& d = tensors_[i].data;
    ok = d.empty() || std::fwrite(d.data(), 1, d.size(), fp) == d.size();
    written += d.size();
    const uint64_t next = i + 1 < tensors_.size() ? std::get<3>(ti[i + 1]) : off;
    while (ok && written < next) {
      const size_t n = size_t(std::min<uint64_t>(sizeof zeros, next - written));
      ok = std::fwrite(zeros, 1, n, fp) == n;
      written += n;
    }
  }
  const int werr = errno;
  if (std::fclose(fp) != 0) ok = false;
  if (!ok) {
    std::remove(path.c_str());
    throw tandem::error("cannot write " + path + ": " + std::strerror(werr) + ": check free disk space");
  }
}

}  // namespace tandem::gguf
