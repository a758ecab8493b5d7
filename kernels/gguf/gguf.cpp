// GGUF reader (v2/v3) and writer (v3). The reader treats the input as hostile: every count,
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

#include "kernels/gguf/type_traits.h"

namespace tandem::gguf {

namespace {

constexpr uint32_t gguf_magic = 0x46554747u;  // "GGUF" little-endian
constexpr uint32_t max_dims = 4;

std::string value_type_name(value_type t) {
  switch (t) {
    case value_type::u8: return "u8";
    case value_type::i8: return "i8";
    case value_type::u16: return "u16";
    case value_type::i16: return "i16";
    case value_type::u32: return "u32";
    case value_type::i32: return "i32";
    case value_type::f32: return "f32";
    case value_type::boolean: return "bool";
    case value_type::string: return "string";
    case value_type::array: return "array";
    case value_type::u64: return "u64";
    case value_type::i64: return "i64";
    case value_type::f64: return "f64";
  }
  return "type " + std::to_string(uint32_t(t));
}

/// Fixed wire size of a scalar type, 0 for string/array/unknown.
size_t scalar_size(value_type t) {
  switch (t) {
    case value_type::u8:
    case value_type::i8:
    case value_type::boolean: return 1;
    case value_type::u16:
    case value_type::i16: return 2;
    case value_type::u32:
    case value_type::i32:
    case value_type::f32: return 4;
    case value_type::u64:
    case value_type::i64:
    case value_type::f64: return 8;
    default: return 0;
  }
}

bool valid_value_type(uint32_t t) { return t <= uint32_t(value_type::f64); }

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

}  // namespace

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
