// Hugging Face safetensors checkpoints: reading through a memory map, writing atomically.
//
// Layout of a file: an 8-byte little-endian u64 N, then N bytes of UTF-8 JSON, then the
// data section. The JSON maps each tensor name to {"dtype", "shape", "data_offsets":
// [begin, end]} with offsets relative to the start of the data section, plus an optional
// "__metadata__" object of string -> string. Elements are little-endian, row-major.
//
// SafetensorsFile maps the file and validates the whole header at open (lengths, JSON
// types, dtypes, shapes, offsets in range, byte sizes that match the shape, no two
// tensors overlapping), so a bad file fails there with one line naming the file and
// tensor rather than yielding garbage later. Gaps between tensors are accepted.
// read<T>() checks the shape the caller expects and converts the stored dtype to T
// (float, double or bf16; int32/int64 for integer tensors), rounding to nearest even.
//
// SafetensorsWriter copies the values in, converted to the stored dtype, and writes
// tensors in name order, contiguously, after a header padded with spaces so that the
// data starts at an 8-byte boundary: the same tensors give the same bytes whatever the
// order they were added in. It writes to `path + ".tmp"` and renames over `path`, so a
// crash never leaves a half-written checkpoint where a good one was.
//
// F16 values are raw bits, converted by io/half.hpp.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/io/crc32.hpp"
#include "tessera/io/half.hpp"
#include "tessera/io/mapped_file.hpp"

namespace tessera::io {

// ---------------------------------------------------------------------------------
// Dtypes as safetensors names them.

enum class StDtype : std::uint8_t { f32, f16, bf16, f64, i32, i64 };

/// The name used in the file's header: "F32", "F16", "BF16", "F64", "I32", "I64".
constexpr std::string_view name_of(StDtype t) {
  switch (t) {
    case StDtype::f32: return "F32";
    case StDtype::f16: return "F16";
    case StDtype::bf16: return "BF16";
    case StDtype::f64: return "F64";
    case StDtype::i32: return "I32";
    case StDtype::i64: return "I64";
  }
  return "?";
}

/// Bytes per element.
constexpr std::size_t size_of(StDtype t) {
  switch (t) {
    case StDtype::f32: return 4;
    case StDtype::f16: return 2;
    case StDtype::bf16: return 2;
    case StDtype::f64: return 8;
    case StDtype::i32: return 4;
    case StDtype::i64: return 8;
  }
  return 0;
}

constexpr bool is_floating(StDtype t) {
  return t == StDtype::f32 || t == StDtype::f16 || t == StDtype::bf16 || t == StDtype::f64;
}

/// Parses a header dtype string; nullopt for a dtype tessera does not handle.
constexpr std::optional<StDtype> parse_st_dtype(std::string_view s) {
  for (StDtype t : {StDtype::f32, StDtype::f16, StDtype::bf16, StDtype::f64, StDtype::i32,
                    StDtype::i64}) {
    if (s == name_of(t)) return t;
  }
  return std::nullopt;
}

// ---------------------------------------------------------------------------------
// Reading.

struct TensorEntry {
  std::string name;
  StDtype dtype = StDtype::f32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;  // absolute byte offsets in the file, [begin, end)
  std::uint64_t end = 0;

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (std::int64_t d : shape) n *= d;
    return n;
  }
  std::uint64_t byte_size() const { return end - begin; }
};

namespace detail {

inline std::string shape_str(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

/// numel of a shape, or nullopt when a dimension is negative or the product overflows.
inline std::optional<std::uint64_t> checked_numel(const std::vector<std::int64_t>& shape) {
  for (std::int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (d == 0) return 0;
  }
  std::uint64_t n = 1;
  for (std::int64_t d : shape) {
    if (n > std::numeric_limits<std::uint64_t>::max() / static_cast<std::uint64_t>(d)) {
      return std::nullopt;
    }
    n *= static_cast<std::uint64_t>(d);
  }
  return n;
}

template <class U>
U load_le(const std::byte* p) {
  U v;
  std::memcpy(&v, p, sizeof(U));
  if constexpr (std::endian::native == std::endian::big) {
    U r = 0;
    for (std::size_t i = 0; i < sizeof(U); ++i) r = static_cast<U>((r << 8) | ((v >> (8 * i)) & 0xffu));
    v = r;
  }
  return v;
}

template <class U>
void store_le(std::byte* p, U v) {
  if constexpr (std::endian::native == std::endian::big) {
    for (std::size_t i = 0; i < sizeof(U); ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xffu);
  } else {
    std::memcpy(p, &v, sizeof(U));
  }
}

template <class T>
constexpr std::string_view element_name() {
  if constexpr (std::is_same_v<T, float>) return "float";
  else if constexpr (std::is_same_v<T, double>) return "double";
  else if constexpr (std::is_same_v<T, bf16>) return "bf16";
  else if constexpr (std::is_same_v<T, std::int32_t>) return "int32";
  else if constexpr (std::is_same_v<T, std::int64_t>) return "int64";
  else return "?";
}

template <class T>
constexpr bool is_float_element =
    std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bf16>;

template <class T>
constexpr bool is_int_element = std::is_same_v<T, std::int32_t> || std::is_same_v<T, std::int64_t>;

/// Element i of floating data stored as `dtype`, as T (one rounding at most).
template <class T>
T load_float_element(StDtype dtype, const std::byte* p) {
  switch (dtype) {
    case StDtype::f32: {
      const float v = std::bit_cast<float>(load_le<std::uint32_t>(p));
      if constexpr (std::is_same_v<T, bf16>) return bf16(v);
      else return static_cast<T>(v);
    }
    case StDtype::f16: {
      const float v = f16_to_float(load_le<std::uint16_t>(p));
      if constexpr (std::is_same_v<T, bf16>) return bf16(v);
      else return static_cast<T>(v);
    }
    case StDtype::bf16: {
      const std::uint16_t b = load_le<std::uint16_t>(p);
      if constexpr (std::is_same_v<T, bf16>) return bf16::from_bits(b);
      else return static_cast<T>(bf16::from_bits_to_float(b));
    }
    case StDtype::f64: {
      const double v = std::bit_cast<double>(load_le<std::uint64_t>(p));
      if constexpr (std::is_same_v<T, bf16>) return double_to_bf16(v);
      else return static_cast<T>(v);
    }
    default: return T{};  // integer dtypes are refused before this is reached
  }
}

/// Reads a non-negative integer from a header value; nullopt for anything else.
inline std::optional<std::uint64_t> json_uint(const nlohmann::json& v) {
  if (v.is_number_unsigned()) return v.get<std::uint64_t>();
  if (v.is_number_integer() && v.get<std::int64_t>() == 0) return 0;  // "-0"
  return std::nullopt;
}

}  // namespace detail

class SafetensorsFile {
 public:
  /// Largest header accepted; larger lengths mean a corrupt or foreign file.
  static constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

  /// Maps `path` and validates its header. Throws tessera::Error naming the file (and
  /// the tensor, where one is concerned) on any malformed input.
  static SafetensorsFile open(const std::string& path) {
    SafetensorsFile f;
    f.file_ = MappedFile::open(path);
    f.parse_header();
    return f;
  }

  const std::string& path() const { return file_.path(); }

  /// Every tensor, sorted by name.
  const std::vector<TensorEntry>& tensors() const { return tensors_; }

  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  bool contains(std::string_view name) const { return find(name) != nullptr; }

  const TensorEntry& entry(std::string_view name) const {
    const TensorEntry* e = find(name);
    if (e == nullptr) fail(path(), ": no tensor '", name, "' in this file (", tensors_.size(), " tensors)");
    return *e;
  }

  /// The stored bytes of a tensor, little-endian, straight from the mapping.
  std::span<const std::byte> raw(std::string_view name) const {
    const TensorEntry& e = entry(name);
    return {file_.data() + e.begin, static_cast<std::size_t>(e.byte_size())};
  }

  /// Reads tensor `name` into `dest`, converting to T. The stored shape must equal
  /// `expected_shape` and dest must hold exactly its numel. Floating tensors (F32, F16,
  /// BF16, F64) read as float, double or bf16; integer ones (I32, I64) as int32 or int64.
  template <class T>
  void read(std::string_view name, std::span<T> dest,
            const std::vector<std::int64_t>& expected_shape) const {
    static_assert(detail::is_float_element<T> || detail::is_int_element<T>,
                  "tessera: SafetensorsFile::read<T>: T must be float, double, bf16, "
                  "std::int32_t or std::int64_t");
    const TensorEntry& e = entry(name);
    if (e.shape != expected_shape) {
      fail(path(), ": tensor '", name, "': shape ", detail::shape_str(e.shape),
           " in the file, expected ", detail::shape_str(expected_shape));
    }
    const auto n = static_cast<std::size_t>(e.numel());
    if (dest.size() != n) {
      fail(path(), ": tensor '", name, "': destination holds ", dest.size(),
           " elements, the tensor has ", n);
    }
    const std::byte* src = file_.data() + e.begin;
    const std::size_t width = size_of(e.dtype);
    if constexpr (detail::is_float_element<T>) {
      if (!is_floating(e.dtype)) {
        fail(path(), ": tensor '", name, "': stored as ", name_of(e.dtype),
             ", an integer dtype, cannot be read as ", detail::element_name<T>());
      }
      constexpr bool little = std::endian::native == std::endian::little;
      if (little && ((std::is_same_v<T, float> && e.dtype == StDtype::f32) ||
                     (std::is_same_v<T, double> && e.dtype == StDtype::f64) ||
                     (std::is_same_v<T, bf16> && e.dtype == StDtype::bf16))) {
        if (n > 0) std::memcpy(static_cast<void*>(dest.data()), src, n * sizeof(T));
        return;
      }
      for (std::size_t i = 0; i < n; ++i) {
        dest[i] = detail::load_float_element<T>(e.dtype, src + i * width);
      }
    } else {
      if (is_floating(e.dtype)) {
        fail(path(), ": tensor '", name, "': stored as ", name_of(e.dtype),
             ", a floating dtype, cannot be read as ", detail::element_name<T>());
      }
      for (std::size_t i = 0; i < n; ++i) {
        std::int64_t v = e.dtype == StDtype::i32
                             ? static_cast<std::int32_t>(detail::load_le<std::uint32_t>(src + i * 4))
                             : static_cast<std::int64_t>(detail::load_le<std::uint64_t>(src + i * 8));
        if constexpr (std::is_same_v<T, std::int32_t>) {
          if (v < std::numeric_limits<std::int32_t>::min() ||
              v > std::numeric_limits<std::int32_t>::max()) {
            fail(path(), ": tensor '", name, "': element ", i, " = ", v, " does not fit in int32");
          }
        }
        dest[i] = static_cast<T>(v);
      }
    }
  }

  /// Reads the whole tensor in its stored shape.
  template <class T>
  std::vector<T> read_all(std::string_view name) const {
    const TensorEntry& e = entry(name);
    std::vector<T> out(static_cast<std::size_t>(e.numel()));
    read<T>(name, std::span<T>(out), e.shape);
    return out;
  }

 private:
  SafetensorsFile() = default;

  const TensorEntry* find(std::string_view name) const {
    auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                               [](const TensorEntry& e, std::string_view n) { return e.name < n; });
    if (it == tensors_.end() || it->name != name) return nullptr;
    return &*it;
  }

  void parse_header() {
    const std::string& p = path();
    const std::uint64_t file_size = file_.size();
    if (file_size < 8) {
      fail(p, ": file is ", file_size,
           " bytes, too short for the 8-byte safetensors header length");
    }
    const std::uint64_t header_len = detail::load_le<std::uint64_t>(file_.data());
    if (header_len > kMaxHeaderBytes) {
      fail(p, ": header length ", header_len, " exceeds the ", kMaxHeaderBytes,
           "-byte limit (not a safetensors file?)");
    }
    if (header_len > file_size - 8) {
      fail(p, ": header length ", header_len, " runs past the end of the file (", file_size,
           " bytes)");
    }
    const std::uint64_t data_start = 8 + header_len;
    const std::uint64_t data_size = file_size - data_start;

    // Duplicate top-level keys are silently merged by JSON parsers; note them instead.
    std::string duplicate;
    std::set<std::string> seen;
    auto on_event = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& value) {
      if (depth == 1 && event == nlohmann::json::parse_event_t::key && duplicate.empty() &&
          value.is_string() && !seen.insert(value.get<std::string>()).second) {
        duplicate = value.get<std::string>();
      }
      return true;
    };
    const char* text = reinterpret_cast<const char*>(file_.data() + 8);
    nlohmann::json header;
    try {
      header = nlohmann::json::parse(text, text + header_len, on_event);
    } catch (const nlohmann::json::exception& e) {
      fail(p, ": header is not valid JSON: ", e.what());
    }
    if (!header.is_object()) fail(p, ": header is not a JSON object but ", header.type_name());
    if (!duplicate.empty()) fail(p, ": header lists '", duplicate, "' twice");

    for (auto& [key, value] : header.items()) {
      if (key == "__metadata__") {
        parse_metadata(value);
        continue;
      }
      tensors_.push_back(parse_entry(key, value, data_start, data_size));
    }
    // header.items() walks the keys in sorted order already; keep the guarantee explicit.
    std::sort(tensors_.begin(), tensors_.end(),
              [](const TensorEntry& a, const TensorEntry& b) { return a.name < b.name; });
    check_overlaps(data_start);
  }

  void parse_metadata(const nlohmann::json& value) {
    if (!value.is_object()) fail(path(), ": __metadata__ is not a JSON object but ", value.type_name());
    for (auto& [k, v] : value.items()) {
      if (!v.is_string()) {
        fail(path(), ": __metadata__ key '", k, "' is not a string but ", v.type_name());
      }
      metadata_.emplace(k, v.get<std::string>());
    }
  }

  TensorEntry parse_entry(const std::string& name, const nlohmann::json& value,
                          std::uint64_t data_start, std::uint64_t data_size) const {
    const std::string& p = path();
    auto where = [&] { return p + ": tensor '" + name + "'"; };
    if (!value.is_object()) fail(where(), ": entry is not a JSON object but ", value.type_name());
    for (const char* field : {"dtype", "shape", "data_offsets"}) {
      if (!value.contains(field)) fail(where(), ": entry has no \"", field, "\"");
    }

    TensorEntry e;
    e.name = name;
    const nlohmann::json& dtype = value.at("dtype");
    if (!dtype.is_string()) fail(where(), ": \"dtype\" is not a string but ", dtype.type_name());
    const std::string dtype_name = dtype.get<std::string>();
    const std::optional<StDtype> parsed = parse_st_dtype(dtype_name);
    if (!parsed) {
      fail(where(), ": unsupported dtype '", dtype_name, "' (expected F32, F16, BF16, F64, I32 or I64)");
    }
    e.dtype = *parsed;

    const nlohmann::json& shape = value.at("shape");
    if (!shape.is_array()) fail(where(), ": \"shape\" is not an array but ", shape.type_name());
    for (const nlohmann::json& d : shape) {
      if (d.is_number_integer() && !d.is_number_unsigned() && d.get<std::int64_t>() < 0) {
        fail(where(), ": negative dimension ", d.get<std::int64_t>(), " in \"shape\" ", shape.dump());
      }
      const std::optional<std::uint64_t> dim = detail::json_uint(d);
      if (!dim || *dim > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        fail(where(), ": \"shape\" ", shape.dump(), " holds ", d.dump(), ", not a dimension");
      }
      e.shape.push_back(static_cast<std::int64_t>(*dim));
    }

    const nlohmann::json& offsets = value.at("data_offsets");
    if (!offsets.is_array() || offsets.size() != 2) {
      fail(where(), ": \"data_offsets\" is not an array of two offsets but ", offsets.dump());
    }
    const std::optional<std::uint64_t> begin = detail::json_uint(offsets[0]);
    const std::optional<std::uint64_t> end = detail::json_uint(offsets[1]);
    if (!begin || !end) {
      fail(where(), ": \"data_offsets\" ", offsets.dump(), " are not non-negative integers");
    }
    if (*begin > *end) fail(where(), ": data_offsets ", offsets.dump(), " begin after they end");
    if (*end > data_size) {
      fail(where(), ": data_offsets ", offsets.dump(), " run past the end of the data section (",
           data_size, " bytes)");
    }
    const std::optional<std::uint64_t> numel = detail::checked_numel(e.shape);
    const std::uint64_t width = size_of(e.dtype);
    if (!numel || *numel > std::numeric_limits<std::uint64_t>::max() / width) {
      fail(where(), ": shape ", detail::shape_str(e.shape), " is too large");
    }
    if (*end - *begin != *numel * width) {
      fail(where(), ": data_offsets ", offsets.dump(), " span ", *end - *begin,
           " bytes but shape ", detail::shape_str(e.shape), " of ", name_of(e.dtype), " needs ",
           *numel * width);
    }
    e.begin = data_start + *begin;
    e.end = data_start + *end;
    return e;
  }

  void check_overlaps(std::uint64_t data_start) const {
    std::vector<const TensorEntry*> by_offset;
    for (const TensorEntry& e : tensors_) {
      if (e.begin != e.end) by_offset.push_back(&e);  // empty tensors occupy no bytes
    }
    std::sort(by_offset.begin(), by_offset.end(), [](const TensorEntry* a, const TensorEntry* b) {
      return a->begin != b->begin ? a->begin < b->begin : a->name < b->name;
    });
    for (std::size_t i = 1; i < by_offset.size(); ++i) {
      const TensorEntry& a = *by_offset[i - 1];
      const TensorEntry& b = *by_offset[i];
      if (b.begin < a.end) {
        fail(path(), ": tensor '", a.name, "' (data_offsets [", a.begin - data_start, ", ",
             a.end - data_start, "]) and tensor '", b.name, "' (data_offsets [",
             b.begin - data_start, ", ", b.end - data_start, "]) overlap");
      }
    }
  }

  MappedFile file_;
  std::vector<TensorEntry> tensors_;
  std::map<std::string, std::string> metadata_;
};

// ---------------------------------------------------------------------------------
// Writing.

class SafetensorsWriter {
 public:
  /// Adds a tensor; the values (row-major, numel(shape) of them) are copied now,
  /// converted to `stored` (F32, F16, BF16 or F64) with rounding to nearest even.
  void add(std::string name, StDtype stored, std::vector<std::int64_t> shape,
           std::span<const float> values) {
    add_values(std::move(name), stored, std::move(shape), values);
  }
  void add(std::string name, StDtype stored, std::vector<std::int64_t> shape,
           std::span<const double> values) {
    add_values(std::move(name), stored, std::move(shape), values);
  }
  void add(std::string name, StDtype stored, std::vector<std::int64_t> shape,
           std::span<const bf16> values) {
    add_values(std::move(name), stored, std::move(shape), values);
  }
  /// Integer tensors, stored as I32 or I64.
  void add(std::string name, StDtype stored, std::vector<std::int64_t> shape,
           std::span<const std::int32_t> values) {
    add_values(std::move(name), stored, std::move(shape), values);
  }
  void add(std::string name, StDtype stored, std::vector<std::int64_t> shape,
           std::span<const std::int64_t> values) {
    add_values(std::move(name), stored, std::move(shape), values);
  }

  /// Adds a tensor whose bytes are already as stored (`stored`, little-endian, row-major),
  /// taking them without a copy: for writers that fill a buffer straight from a device.
  void add_bytes(std::string name, StDtype stored, std::vector<std::int64_t> shape, std::vector<std::byte> bytes) {
    const std::string where = "SafetensorsWriter: tensor '" + name + "'";
    if (name.empty()) fail("SafetensorsWriter: a tensor name is empty");
    if (name == "__metadata__") fail(where, ": the name is reserved for metadata");
    check_utf8(name, "tensor name '" + name + "'");
    if (tensors_.count(name)) fail(where, ": added twice");
    const std::optional<std::uint64_t> numel = detail::checked_numel(shape);
    if (!numel) fail(where, ": shape ", detail::shape_str(shape), " has a negative dimension or is too large");
    if (*numel * size_of(stored) != bytes.size())
      fail(where, ": shape ", detail::shape_str(shape), " of ", name_of(stored), " takes ", *numel * size_of(stored),
           " bytes but ", bytes.size(), " were given");
    Pending t;
    t.dtype = stored;
    t.shape = std::move(shape);
    t.data = std::move(bytes);
    tensors_.emplace(std::move(name), std::move(t));
  }

  /// Empties the writer, handing back the tensors' byte buffers (for a caller that
  /// reuses them: a buffer already in memory costs no page faults the next time).
  std::vector<std::vector<std::byte>> take_buffers() {
    std::vector<std::vector<std::byte>> out;
    out.reserve(tensors_.size());
    for (auto& [name, t] : tensors_) out.push_back(std::move(t.data));
    tensors_.clear();
    return out;
  }

  /// Sets (or replaces) a "__metadata__" entry.
  void set_metadata(std::string key, std::string value) {
    check_utf8(key, "metadata key");
    check_utf8(value, "metadata value for '" + key + "'");
    metadata_[std::move(key)] = std::move(value);
  }

  std::size_t size() const { return tensors_.size(); }
  bool contains(std::string_view name) const { return tensors_.find(std::string(name)) != tensors_.end(); }

  /// The CRC-32C of tensor `name`'s bytes as they will be written.
  std::uint32_t crc32c(std::string_view name) const {
    const auto it = tensors_.find(std::string(name));
    if (it == tensors_.end()) fail("SafetensorsWriter: no tensor '", name, "' to checksum");
    return io::crc32c(it->second.data.data(), it->second.data.size());
  }
  /// Every tensor's CRC-32C, by name.
  std::map<std::string, std::uint32_t> crc32cs() const {
    std::map<std::string, std::uint32_t> out;
    for (const auto& [name, t] : tensors_) out.emplace(name, io::crc32c(t.data.data(), t.data.size()));
    return out;
  }

  /// The bytes the file will hold: the length, the header, the tensors.
  std::uint64_t file_bytes() const {
    std::uint64_t n = 8 + header().size();
    for (const auto& [name, t] : tensors_) n += t.data.size();
    return n;
  }

  /// The header text as written (JSON followed by the padding spaces).
  std::string header() const {
    nlohmann::ordered_json h = nlohmann::ordered_json::object();
    if (!metadata_.empty()) {
      nlohmann::ordered_json m = nlohmann::ordered_json::object();
      for (const auto& [k, v] : metadata_) m[k] = v;
      h["__metadata__"] = std::move(m);
    }
    std::uint64_t offset = 0;
    for (const auto& [name, t] : tensors_) {
      const std::uint64_t end = offset + t.data.size();
      h[name] = {{"dtype", std::string(name_of(t.dtype))},
                 {"shape", t.shape},
                 {"data_offsets", {offset, end}}};
      offset = end;
    }
    std::string text = h.dump();
    text.append((8 - (8 + text.size()) % 8) % 8, ' ');  // data starts 8-byte aligned
    return text;
  }

  /// Writes the file: to `path + ".tmp"` first, then renamed over `path`. Creates
  /// missing parent directories.
  void write(const std::string& path) const {
    const std::filesystem::path target(path);
    if (target.has_parent_path()) {
      std::error_code ec;
      std::filesystem::create_directories(target.parent_path(), ec);
      if (ec) fail(path, ": cannot create directory ", target.parent_path().string(), ": ", ec.message());
    }
    const std::string text = header();
    std::byte length[8];
    detail::store_le<std::uint64_t>(length, text.size());

    const std::string tmp = path + ".tmp";
    int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
      int err = errno;
      fail(tmp, ": cannot open for writing: ", std::strerror(err));
    }
    auto abandon = [&](const char* what) {
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      fail(tmp, ": ", what, ": ", std::strerror(err));
    };
    if (!write_all(fd, length, sizeof length)) abandon("write failed");
    if (!write_all(fd, text.data(), text.size())) abandon("write failed");
    for (const auto& [name, t] : tensors_) {
      if (!write_all(fd, t.data.data(), t.data.size())) abandon("write failed");
    }
    if (::fsync(fd) != 0) abandon("fsync failed");
    if (::close(fd) != 0) {
      int err = errno;
      ::unlink(tmp.c_str());
      fail(tmp, ": close failed: ", std::strerror(err));
    }
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      int err = errno;
      ::unlink(tmp.c_str());
      fail(path, ": cannot rename ", tmp, " over it: ", std::strerror(err));
    }
  }

 private:
  struct Pending {
    StDtype dtype = StDtype::f32;
    std::vector<std::int64_t> shape;
    std::vector<std::byte> data;  // little-endian, as written
  };

  static bool write_all(int fd, const void* data, std::size_t size) {
    const char* p = static_cast<const char*>(data);
    while (size > 0) {
      const std::size_t chunk = std::min<std::size_t>(size, std::size_t{1} << 30);
      const ssize_t n = ::write(fd, p, chunk);
      if (n < 0) {
        if (errno == EINTR) continue;
        return false;
      }
      p += n;
      size -= static_cast<std::size_t>(n);
    }
    return true;
  }

  static void check_utf8(const std::string& s, const std::string& what) {
    try {
      (void)nlohmann::json(s).dump();
    } catch (const nlohmann::json::exception&) {
      fail("SafetensorsWriter: ", what, " is not valid UTF-8");
    }
  }

  template <class V>
  void add_values(std::string name, StDtype stored, std::vector<std::int64_t> shape,
                  std::span<const V> values) {
    const std::string where = "SafetensorsWriter: tensor '" + name + "'";
    if (name.empty()) fail("SafetensorsWriter: a tensor name is empty");
    if (name == "__metadata__") fail(where, ": the name is reserved for metadata");
    check_utf8(name, "tensor name '" + name + "'");
    if (tensors_.count(name)) fail(where, ": added twice");
    constexpr bool float_values = !std::is_integral_v<V>;
    if (float_values != is_floating(stored)) {
      fail(where, ": ", detail::element_name<V>(), " values cannot be stored as ", name_of(stored));
    }
    const std::optional<std::uint64_t> numel = detail::checked_numel(shape);
    if (!numel) fail(where, ": shape ", detail::shape_str(shape), " has a negative dimension or is too large");
    if (*numel != values.size()) {
      fail(where, ": shape ", detail::shape_str(shape), " holds ", *numel, " elements but ",
           values.size(), " values were given");
    }

    Pending t;
    t.dtype = stored;
    t.shape = std::move(shape);
    const std::size_t width = size_of(stored);
    t.data.resize(values.size() * width);
    std::byte* out = t.data.data();
    for (std::size_t i = 0; i < values.size(); ++i, out += width) {
      const V v = values[i];
      if constexpr (float_values) {
        switch (stored) {
          case StDtype::f32:
            detail::store_le(out, std::bit_cast<std::uint32_t>(static_cast<float>(v)));
            break;
          case StDtype::f16:
            if constexpr (std::is_same_v<V, double>) detail::store_le(out, double_to_f16(v));
            else detail::store_le(out, float_to_f16(static_cast<float>(v)));
            break;
          case StDtype::bf16:
            if constexpr (std::is_same_v<V, double>) detail::store_le(out, double_to_bf16(v).bits);
            else if constexpr (std::is_same_v<V, bf16>) detail::store_le(out, v.bits);
            else detail::store_le(out, bf16(v).bits);
            break;
          case StDtype::f64:
            if constexpr (std::is_same_v<V, bf16>) {
              detail::store_le(out, std::bit_cast<std::uint64_t>(static_cast<double>(static_cast<float>(v))));
            } else {
              detail::store_le(out, std::bit_cast<std::uint64_t>(static_cast<double>(v)));
            }
            break;
          default: break;
        }
      } else {
        if (stored == StDtype::i32) {
          if (v < std::numeric_limits<std::int32_t>::min() || v > std::numeric_limits<std::int32_t>::max()) {
            fail(where, ": value ", v, " at index ", i, " does not fit in I32");
          }
          detail::store_le(out, static_cast<std::uint32_t>(static_cast<std::int32_t>(v)));
        } else {
          detail::store_le(out, static_cast<std::uint64_t>(static_cast<std::int64_t>(v)));
        }
      }
    }
    tensors_.emplace(std::move(name), std::move(t));
  }

  std::map<std::string, Pending> tensors_;  // sorted by name: the order in the file
  std::map<std::string, std::string> metadata_;
};

}  // namespace tessera::io
