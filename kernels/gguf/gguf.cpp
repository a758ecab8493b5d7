// GGUF reader (v2/v3); the writer is gguf_writer.cpp. The reader treats the input as hostile: every count,
// length and offset is checked against the bytes that remain and against parse_limits before
// anything is allocated, so a fuzzer cannot make it crash or allocate without bound.
#include "kernels/gguf/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <unordered_set>

#include "kernels/gguf/gguf_format.h"
#include "kernels/gguf/type_traits.h"

namespace tandem::gguf {

using namespace format;

// ---------------------------------------------------------------------------------------------
// value accessors

uint64_t value::as_u64() const {
  if (auto* u = std::get_if<uint64_t>(&v)) return *u;
  if (auto* i = std::get_if<int64_t>(&v)) {
    if (*i < 0) throw error("value " + std::to_string(*i) + " is negative where an unsigned integer is expected");
    return uint64_t(*i);
  }
  throw error("value of type " + value_type_name(type) + " where an integer is expected");
}

int64_t value::as_i64() const {
  if (auto* i = std::get_if<int64_t>(&v)) return *i;
  if (auto* u = std::get_if<uint64_t>(&v)) {
    if (*u > uint64_t(std::numeric_limits<int64_t>::max()))
      throw error("value " + std::to_string(*u) + " does not fit a signed 64-bit integer");
    return int64_t(*u);
  }
  throw error("value of type " + value_type_name(type) + " where an integer is expected");
}

double value::as_f64() const {
  if (auto* d = std::get_if<double>(&v)) return *d;
  if (auto* u = std::get_if<uint64_t>(&v)) return double(*u);
  if (auto* i = std::get_if<int64_t>(&v)) return double(*i);
  throw error("value of type " + value_type_name(type) + " where a number is expected");
}

bool value::as_bool() const {
  if (auto* b = std::get_if<bool>(&v)) return *b;
  throw error("value of type " + value_type_name(type) + " where a bool is expected");
}

const std::string& value::as_string() const {
  if (auto* s = std::get_if<std::string>(&v)) return *s;
  throw error("value of type " + value_type_name(type) + " where a string is expected");
}

const array_value& value::as_array() const {
  if (auto* a = std::get_if<std::shared_ptr<array_value>>(&v); a && *a) return **a;
  throw error("value of type " + value_type_name(type) + " where an array is expected");
}

// ---------------------------------------------------------------------------------------------
// tensor_info

tensor_view tensor_info::view() const {
  if (!is_supported(type)) {
    throw tandem::error(error_kind::unimplemented,
                        "tensor '" + name + "' has type " + std::string(type_name(uint32_t(type))) +
                            ", which Tandem cannot compute with (supported: " + std::string(supported_types_list) +
                            "): re-quantize the model to one of those");
  }
  tensor_view tv;
  tv.type = type;
  tv.n_dims = int(dims.size());
  for (size_t i = 0; i < dims.size() && i < 4; ++i) tv.ne[i] = dims[i];
  tv.data = data;
  tv.nbytes = nbytes;
  return tv;
}

// ---------------------------------------------------------------------------------------------
// parser

struct file::mapping {
  void* addr = nullptr;
  size_t len = 0;
  ~mapping() {
    if (addr != nullptr) ::munmap(addr, len);
  }
};

class parser {
 public:
  parser(std::span<const uint8_t> b, const parse_limits& lim, std::string name)
      : b_(b), lim_(lim), name_(std::move(name)) {}

  void run(file& f) {
    f.name_ = name_;
    const uint32_t magic = u32("the magic");
    if (magic != gguf_magic) {
      fail(0, "is not a GGUF file (magic bytes are not \"GGUF\")",
           "pass a .gguf model file (convert other formats with llama.cpp's convert_hf_to_gguf.py)");
    }
    const uint32_t version = u32("the version");
    if (version == 1) {
      fail(4, "is GGUF version 1, which is not supported", "re-convert the model with a current converter (v3)");
    }
    if (version != 2 && version != 3) {
      const bool swapped = version == 0x02000000u || version == 0x03000000u;
      fail(4, swapped ? "is a big-endian GGUF file, which is not supported"
                      : "has unknown GGUF version " + std::to_string(version),
           "re-convert the model to little-endian GGUF v3");
    }
    f.version_ = version;
    const uint64_t n_tensors = u64("the tensor count");
    const uint64_t n_kv = u64("the metadata count");
    if (n_tensors > lim_.max_tensors)
      fail(8, "declares " + std::to_string(n_tensors) + " tensors (limit " + std::to_string(lim_.max_tensors) + ")",
           "the file is corrupt or not a model; re-download or re-convert it");
    if (n_kv > lim_.max_kv)
      fail(16, "declares " + std::to_string(n_kv) + " metadata entries (limit " + std::to_string(lim_.max_kv) + ")",
           "the file is corrupt; re-download or re-convert it");
    // Each kv needs at least 12 bytes (key length + type), each tensor info at least 24.
    if (n_kv * 12 > remaining() || n_tensors * 24 > remaining() - n_kv * 12) {
      truncated(pos_, "for " + std::to_string(n_kv) + " metadata entries and " + std::to_string(n_tensors) +
                          " tensor infos");
    }

    std::unordered_set<std::string> keys;
    f.kv_.reserve(size_t(n_kv));
    for (uint64_t i = 0; i < n_kv; ++i) {
      const uint64_t at = pos_;
      std::string key = str("metadata key #" + std::to_string(i));
      if (!keys.insert(key).second)
        fail(at, "has the metadata key '" + key + "' twice", "re-convert the model");
      const uint32_t t = u32("the type of key '" + key + "'");
      if (!valid_value_type(t))
        fail(pos_ - 4, "has unknown value type " + std::to_string(t) + " for key '" + key + "'",
             "the file is corrupt or from a newer GGUF version; re-convert it");
      value v = read_value(value_type(t), key, 0);
      f.kv_.emplace_back(std::move(key), std::move(v));
    }

    if (const value* a = f.find("general.alignment")) {
      uint64_t al = 0;
      if (a->type != value_type::u32 || (al = a->as_u64()) == 0 || (al & (al - 1)) != 0) {
        fail(0, "has an invalid general.alignment (must be a u32 power of two)", "re-convert the model");
      }
      f.alignment_ = al;
    } else {
      f.alignment_ = 32;
    }

    std::unordered_set<std::string> names;
    f.tensors_.reserve(size_t(n_tensors));
    for (uint64_t i = 0; i < n_tensors; ++i) {
      const uint64_t at = pos_;
      tensor_info ti;
      ti.name = str("the name of tensor #" + std::to_string(i));
      if (!names.insert(ti.name).second) fail(at, "has the tensor '" + ti.name + "' twice", "re-convert the model");
      const std::string what = "tensor '" + ti.name + "'";
      const uint32_t nd = u32("the dimension count of " + what);
      if (nd > max_dims)
        fail(pos_ - 4, "has " + std::to_string(nd) + " dimensions for " + what + " (at most 4)", "re-convert the model");
      int64_t n_elems = 1;
      for (uint32_t d = 0; d < nd; ++d) {
        const uint64_t dim = u64("the dimensions of " + what);
        if (dim == 0 || dim > uint64_t(std::numeric_limits<int64_t>::max()))
          fail(pos_ - 8, "has invalid dimension " + std::to_string(dim) + " for " + what, "re-convert the model");
        if (int64_t(dim) > std::numeric_limits<int64_t>::max() / n_elems)
          fail(pos_ - 8, "has dimensions for " + what + " whose product overflows", "re-convert the model");
        n_elems *= int64_t(dim);
        ti.dims.push_back(int64_t(dim));
      }
      const uint32_t type = u32("the type of " + what);
      const type_traits tt = traits(type);
      std::string shape = "[";  // for messages: "[256, 32]", innermost first as in ggml
      for (size_t d = 0; d < ti.dims.size(); ++d) shape += (d > 0 ? ", " : "") + std::to_string(ti.dims[d]);
      shape += "]";
      if (tt.block_size == 0)
        fail(pos_ - 4, "has unknown tensor type " + std::to_string(type) + " for " + what + " of shape " + shape,
             "the file is corrupt or uses a newer ggml type; re-convert the model");
      ti.type = ggml_type(type);
      const int64_t ne0 = ti.dims.empty() ? 1 : ti.dims[0];
      if (ne0 % tt.block_size != 0)
        fail(pos_ - 4, "has " + what + " of type " + std::string(tt.name) + " and shape " + shape +
                           " whose row length " + std::to_string(ne0) + " is not a multiple of the block size " +
                           std::to_string(tt.block_size), "re-convert the model");
      // rows * row_bytes cannot overflow: n_elems fits int64 and type_size <= block_size * 9.
      const uint64_t row = uint64_t(ne0 / tt.block_size) * tt.type_size;
      const unsigned __int128 total = (unsigned __int128)row * uint64_t(n_elems / ne0);
      if (total > b_.size())
        fail(at, "has " + what + " of type " + std::string(tt.name) + " and shape " + shape + ": " +
                     std::to_string(uint64_t(total)) + " bytes, larger than the file",
             "the file is truncated or corrupt; re-download or re-convert the model");
      ti.nbytes = size_t(total);
      ti.offset = u64("the offset of " + what);
      if (ti.offset % f.alignment_ != 0)
        fail(pos_ - 8, "has " + what + " at data offset " + std::to_string(ti.offset) +
                           ", not a multiple of the alignment " + std::to_string(f.alignment_),
             "re-convert the model");
      f.tensors_.push_back(std::move(ti));
    }

    const uint64_t data_start = align_up(pos_, f.alignment_);
    if (n_tensors == 0) return;
    if (data_start > b_.size())
      truncated(b_.size(), "of padding before the tensor data", data_start - b_.size());
    const uint64_t data_size = b_.size() - data_start;
    for (auto& ti : f.tensors_) {
      if (ti.offset > data_size || ti.nbytes > data_size - ti.offset) {
        const uint64_t end = data_start + ti.offset + ti.nbytes;  // cannot overflow: both <= file size
        std::string shape;
        for (int64_t d : ti.dims) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
        truncated(b_.size(), "for tensor '" + ti.name + "' of type " + std::string(type_name(uint32_t(ti.type))) +
                                 " and shape [" + shape + "]",
                  end - b_.size());
      }
      ti.data = b_.data() + data_start + ti.offset;
      // The kernels read elements and blocks in place (f32 words, f16 halves, block scales):
      // data must sit at a multiple of their alignment, which general.alignment = 1 or 2 allows
      // a file to break.
      const uint64_t ts = traits(uint32_t(ti.type)).type_size;
      const uint64_t need = ts % 4 == 0 ? 4 : ts % 2 == 0 ? 2 : 1;
      if (reinterpret_cast<uintptr_t>(ti.data) % need != 0)
        fail(data_start + ti.offset,
             "has tensor '" + ti.name + "' of type " + std::string(type_name(uint32_t(ti.type))) + " at file offset " +
                 std::to_string(data_start + ti.offset) + ", not a multiple of its " + std::to_string(need) +
                 "-byte element alignment",
             "re-convert the model with the default general.alignment (32)");
    }
  }

 private:
  [[noreturn]] void fail(uint64_t at, const std::string& what, const std::string& todo) const {
    throw error("GGUF file " + name_ + " " + what + " (at byte offset " + std::to_string(at) + "): " + todo);
  }
  [[noreturn]] void truncated(uint64_t at, const std::string& what, uint64_t more = 0) const {
    std::string m = "GGUF file " + name_ + " is truncated at offset " + std::to_string(at);
    if (more) m += " (expected " + std::to_string(more) + " more bytes " + what + ")";
    else m += " (not enough bytes " + what + ")";
    throw error(m + ": re-download or re-convert the model");
  }
  uint64_t remaining() const { return b_.size() - pos_; }
  // `what` + `key` describe the field; they are only joined when the field is missing,
  // so reading 32000 vocabulary strings builds no messages.
  void need(uint64_t n, std::string_view what, std::string_view key = {}) const {
    if (n > remaining())
      truncated(b_.size(), "for " + std::string(what) + std::string(key), n - remaining());
  }
  template <class T>
  T rd(std::string_view what, std::string_view key = {}) {
    need(sizeof(T), what, key);
    T x;
    std::memcpy(&x, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return x;
  }
  uint32_t u32(std::string_view what) { return rd<uint32_t>(what); }
  uint64_t u64(std::string_view what) { return rd<uint64_t>(what); }
  std::string str(std::string_view what, std::string_view key = {}) {
    const uint64_t at = pos_;
    const uint64_t n = rd<uint64_t>(what, key);
    if (n > lim_.max_string_bytes)
      fail(at, "has a string of " + std::to_string(n) + " bytes in " + std::string(what) + std::string(key) +
                   " (limit " + std::to_string(lim_.max_string_bytes) + ")",
           "the file is corrupt; re-download or re-convert it");
    need(n, what, key);
    std::string s(reinterpret_cast<const char*>(b_.data() + pos_), size_t(n));
    pos_ += n;
    return s;
  }

  value read_value(value_type t, const std::string& key, uint32_t depth) {
    value v;
    v.type = t;
    constexpr std::string_view what = "the value of ";
    switch (t) {
      case value_type::u8: v.v = uint64_t(rd<uint8_t>(what, key)); break;
      case value_type::i8: v.v = int64_t(rd<int8_t>(what, key)); break;
      case value_type::u16: v.v = uint64_t(rd<uint16_t>(what, key)); break;
      case value_type::i16: v.v = int64_t(rd<int16_t>(what, key)); break;
      case value_type::u32: v.v = uint64_t(rd<uint32_t>(what, key)); break;
      case value_type::i32: v.v = int64_t(rd<int32_t>(what, key)); break;
      case value_type::u64: v.v = rd<uint64_t>(what, key); break;
      case value_type::i64: v.v = rd<int64_t>(what, key); break;
      case value_type::f32: v.v = double(rd<float>(what, key)); break;
      case value_type::f64: v.v = rd<double>(what, key); break;
      case value_type::boolean: {
        const uint8_t b = rd<uint8_t>(what, key);
        if (b > 1) fail(pos_ - 1, "has bool value " + std::to_string(b) + " for '" + key + "'", "re-convert the model");
        v.v = b != 0;
        break;
      }
      case value_type::string: v.v = str(what, key); break;
      case value_type::array: {
        if (depth >= lim_.max_array_depth)
          fail(pos_, "nests arrays deeper than " + std::to_string(lim_.max_array_depth) + " in '" + key + "'",
               "the file is corrupt; re-convert it");
        const uint32_t et = u32("the element type of '" + key + "'");
        if (!valid_value_type(et))
          fail(pos_ - 4, "has unknown array element type " + std::to_string(et) + " in '" + key + "'",
               "the file is corrupt; re-convert it");
        const uint64_t at = pos_;
        const uint64_t n = u64("the length of '" + key + "'");
        if (n > lim_.max_array_items)
          fail(at, "has an array of " + std::to_string(n) + " items in '" + key + "' (limit " +
                       std::to_string(lim_.max_array_items) + ")", "the file is corrupt; re-convert it");
        // Minimum wire size per element bounds the allocation by the bytes that are left.
        const value_type etype = value_type(et);
        const uint64_t min_elem = etype == value_type::string ? 8 : etype == value_type::array ? 12 : scalar_size(etype);
        if (n * min_elem > remaining()) truncated(b_.size(), "for the array '" + key + "'", n * min_elem - remaining());
        auto arr = std::make_shared<array_value>();
        arr->elem_type = etype;
        arr->items.reserve(size_t(n));
        for (uint64_t i = 0; i < n; ++i) arr->items.push_back(read_value(etype, key, depth + 1));
        v.v = std::move(arr);
        break;
      }
    }
    return v;
  }

  std::span<const uint8_t> b_;
  const parse_limits& lim_;
  std::string name_;
  uint64_t pos_ = 0;
};

// ---------------------------------------------------------------------------------------------
// file

file::file(file&&) noexcept = default;
file& file::operator=(file&&) noexcept = default;
file::~file() = default;

file file::parse(std::span<const uint8_t> bytes, const parse_limits& lim, std::string name) {
  file f;
  parser p(bytes, lim, std::move(name));
  p.run(f);
  return f;
}

file file::open(const std::string& path, const parse_limits& lim) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw error("cannot open GGUF file " + path + ": " + std::strerror(errno) +
                ": check the path (create a test model with `tandem make-model --out FILE`)");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw error("GGUF file " + path + " is not a regular file: pass the path of a .gguf file");
  }
  if (st.st_size == 0) {
    ::close(fd);
    throw error("GGUF file " + path + " is empty (truncated at offset 0): re-download or re-convert the model");
  }
  void* addr = ::mmap(nullptr, size_t(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
  const int mmap_errno = errno;
  ::close(fd);
  if (addr == MAP_FAILED) {
    throw error("cannot mmap GGUF file " + path + ": " + std::strerror(mmap_errno) +
                ": check free address space / memory limits");
  }
  auto m = std::make_unique<mapping>();
  m->addr = addr;
  m->len = size_t(st.st_size);
  file f = parse(std::span<const uint8_t>(static_cast<const uint8_t*>(addr), m->len), lim, path);
  f.map_ = std::move(m);
  return f;
}

const value* file::find(std::string_view key) const {
  for (auto& [k, v] : kv_)
    if (k == key) return &v;
  return nullptr;
}

namespace {
template <class F>
decltype(auto) with_key(const file& f, std::string_view key, F&& fn) {
  const value* v = f.find(key);
  if (v == nullptr)
    throw error("GGUF file " + f.name() + " has no metadata key '" + std::string(key) +
                "': the model was converted without it; re-convert it with a current converter");
  try {
    return fn(*v);
  } catch (const error& e) {
    throw error("GGUF file " + f.name() + ", key '" + std::string(key) + "': " + e.what() +
                "; re-convert the model");
  }
}
}  // namespace

uint64_t file::get_u64(std::string_view key) const {
  return with_key(*this, key, [](const value& v) { return v.as_u64(); });
}
uint32_t file::get_u32(std::string_view key) const {
  return with_key(*this, key, [](const value& v) {
    const uint64_t x = v.as_u64();
    if (x > std::numeric_limits<uint32_t>::max()) throw error("value " + std::to_string(x) + " does not fit 32 bits");
    return uint32_t(x);
  });
}
float file::get_f32(std::string_view key) const {
  return with_key(*this, key, [](const value& v) { return float(v.as_f64()); });
}
const std::string& file::get_string(std::string_view key) const {
  return with_key(*this, key, [](const value& v) -> const std::string& { return v.as_string(); });
}
const array_value& file::get_array(std::string_view key) const {
  return with_key(*this, key, [](const value& v) -> const array_value& { return v.as_array(); });
}
uint64_t file::get_u64_or(std::string_view key, uint64_t def) const {
  return find(key) ? get_u64(key) : def;
}
float file::get_f32_or(std::string_view key, float def) const {
  return find(key) ? get_f32(key) : def;
}

const tensor_info* file::find_tensor(std::string_view name) const {
  for (auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

const tensor_info& file::tensor(std::string_view name) const {
  if (const tensor_info* t = find_tensor(name)) return *t;
  throw error("GGUF file " + name_ + " has no tensor '" + std::string(name) +
              "': the model is incomplete or of another architecture; re-convert it");
}

}  // namespace tandem::gguf
