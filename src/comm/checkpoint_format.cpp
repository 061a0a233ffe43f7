// The checkpoint formats' encoders and validating parsers (see checkpoint_format.hpp and
// docs/checkpoint.md). The safetensors rules follow huggingface/safetensors'
// safetensors/src/tensor.rs (read at commit 24b0b2857fef49be734b9ab72ce97c09bb25f5b9): the header
// length limit, '{' first, the header padded with spaces to a multiple of 8, the tensors sorted by
// offset covering the data buffer from 0 to its end with no hole or overlap, each one's byte count
// checked against dtype x shape with overflow checks. tensordict's memmap layout follows
// pytorch/tensordict's tensordict/_td.py (_memmap_, _load_memmap), _td_memmap.py
// (_save_metadata, _update_metadata) and _utils_key_json.py (_encode_key_for_filesystem), read at
// commit a1a061e3dd4b4c892925525a726a72c9eef9a0cc.
#include "comm/checkpoint_format.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <set>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "tensordict/errors.hpp"

namespace td::detail {

static_assert(std::endian::native == std::endian::little,
              "safetensors and memmap files hold little-endian data, written in native order");

namespace {

// std::map-backed (nlohmann::ordered_json looks keys up linearly: quadratic for 16384 tensors); the
// order of a meta.json's entries comes from the parser callback instead.
using Json = nlohmann::json;

// The reference's dtypes (tensor.rs, enum Dtype) with their sizes in bits, and the library dtype
// each one is (none for those the library lacks).
struct FormatDType {
  std::string_view name;
  unsigned bits;
  std::optional<DType> dtype;
};
constexpr std::array<FormatDType, 22> kFormatDTypes{{
    {"BOOL", 8, DType::Bool},         {"U8", 8, DType::UInt8},
    {"I8", 8, DType::Int8},           {"I16", 16, DType::Int16},
    {"I32", 32, DType::Int32},        {"I64", 64, DType::Int64},
    {"F16", 16, DType::Float16},      {"BF16", 16, DType::BFloat16},
    {"F32", 32, DType::Float32},      {"F64", 64, DType::Float64},
    {"C64", 64, DType::Complex64},    {"U16", 16, std::nullopt},
    {"U32", 32, std::nullopt},        {"U64", 64, std::nullopt},
    {"F4", 4, std::nullopt},          {"F6_E2M3", 6, std::nullopt},
    {"F6_E3M2", 6, std::nullopt},     {"F8_E5M2", 8, std::nullopt},
    {"F8_E4M3", 8, std::nullopt},     {"F8_E8M0", 8, std::nullopt},
    {"F8_E4M3FNUZ", 8, std::nullopt}, {"F8_E5M2FNUZ", 8, std::nullopt},
}};

const FormatDType* find_format_dtype(std::string_view name) {
  for (const auto& d : kFormatDTypes)
    if (d.name == name) return &d;
  return nullptr;
}

// Rejects JSON nested deeper than the formats need (an object of objects of arrays) and, at the
// top level, duplicate names (which a JSON object would silently keep the last of). Thrown from
// the parser callback, so parsing stops there.
struct JsonRejected {
  std::string why;
};

// A first pass over the text without building anything: the nesting depth, the top-level names
// (duplicates, order). Not the DOM parser's callback: nlohmann's callback parser rescans an
// object's members at its end, quadratic in the number of tensors.
class Scan : public nlohmann::json_sax<Json> {
 public:
  Scan(int max_depth, std::vector<std::string>& order) : max_depth_(max_depth), order_(order) {}
  bool null() override { return true; }
  bool boolean(bool /*val*/) override { return true; }
  bool number_integer(number_integer_t /*val*/) override { return true; }
  bool number_unsigned(number_unsigned_t /*val*/) override { return true; }
  bool number_float(number_float_t /*val*/, const string_t& /*s*/) override { return true; }
  bool string(string_t& /*val*/) override { return true; }
  bool binary(binary_t& /*val*/) override { return true; }
  bool start_object(std::size_t /*elements*/) override { return enter(); }
  bool end_object() override { return leave(); }
  bool start_array(std::size_t /*elements*/) override { return enter(); }
  bool end_array() override { return leave(); }
  bool key(string_t& val) override {
    if (depth_ == 1) {
      if (!seen_.insert(val).second)
        throw JsonRejected{fmt::format("the name '{}' appears twice", val)};
      order_.push_back(val);
    }
    return true;
  }
  bool parse_error(std::size_t /*position*/, const std::string& /*last_token*/,
                   const nlohmann::detail::exception& /*ex*/) override {
    return false;  // the DOM parser reports it, with its message
  }

 private:
  bool enter() {
    if (++depth_ > max_depth_)
      throw JsonRejected{fmt::format("nested deeper than {} levels", max_depth_)};
    return true;
  }
  bool leave() {
    --depth_;
    return true;
  }
  int max_depth_;
  int depth_ = 0;
  std::set<std::string> seen_;
  std::vector<std::string>& order_;
};

// The document; `order` receives the top-level object's names in file order.
Json parse_json(std::string_view text, int max_depth, std::vector<std::string>& order) {
  Scan scan(max_depth, order);
  Json::sax_parse(text.begin(), text.end(), &scan);
  return Json::parse(text.begin(), text.end());
}

// Parses `text` (a header or meta.json), turning every parser complaint into td::Error.
Json parse_checked(std::string_view text, int max_depth, std::string_view file,
                   std::string_view what, std::vector<std::string>& order) {
  try {
    return parse_json(text, max_depth, order);
  } catch (const JsonRejected& r) {
    throw Error(fmt::format("{}: invalid {}: {}", file, what, r.why));
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("{}: invalid {} (not valid UTF-8 JSON): {}", file, what, e.what()));
  }
}

// A JSON array of non-negative integers as a shape (sizes up to INT64_MAX, kCheckpointMaxDims).
std::optional<Shape> shape_of(const Json& j) {
  if (!j.is_array() || j.size() > kCheckpointMaxDims) return std::nullopt;
  Shape s;
  for (const auto& d : j) {
    if (!d.is_number_unsigned()) return std::nullopt;
    const auto v = d.get<std::uint64_t>();
    if (v > static_cast<std::uint64_t>(INT64_MAX)) return std::nullopt;
    s.push_back(static_cast<std::int64_t>(v));
  }
  return s;
}

// numel(shape) * bits / 8, or nullopt when a product overflows 64 bits.
std::optional<std::uint64_t> byte_count(const Shape& shape, unsigned bits) {
  std::uint64_t n = 1;
  for (const std::int64_t d : shape)
    if (__builtin_mul_overflow(n, static_cast<std::uint64_t>(d), &n)) return std::nullopt;
  std::uint64_t b = 0;
  if (__builtin_mul_overflow(n, std::uint64_t{bits}, &b)) return std::nullopt;
  if (n > static_cast<std::uint64_t>(INT64_MAX)) return std::nullopt;
  return (b + 7) / 8;
}

std::string dump_strict(const Json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::strict);
}

// A JSON string as Python's json.dumps writes it (non-ASCII escaped); td::Error for bad UTF-8.
std::string json_string(std::string_view s, bool ascii) {
  try {
    return Json(s).dump(-1, ' ', ascii, nlohmann::json::error_handler_t::strict);
  } catch (const nlohmann::json::exception&) {
    throw Error(fmt::format("a name is not valid UTF-8 ({} bytes)", s.size()));
  }
}

// A shape as JSON, with Python's ", " separator or without.
std::string json_shape(const Shape& s, std::string_view sep) {
  return fmt::format("[{}]", fmt::join(s, sep));
}

}  // namespace

std::optional<std::string_view> safetensors_dtype_name(DType dtype) {
  for (const auto& d : kFormatDTypes)
    if (d.dtype == dtype) return d.name;
  return std::nullopt;
}

std::string flat_name(const KeyPath& key) {
  std::string out;
  for (const auto& p : key) {
    if (!out.empty()) out += '.';
    out += p;
  }
  return out;
}

// ---- safetensors header --------------------------------------------------------------------

std::uint64_t safetensors_header_length(std::span<const std::byte> first_bytes,
                                        std::uint64_t file_size, std::string_view file) {
  if (file_size < 8 || first_bytes.size() < 8)
    throw Error(fmt::format(
        "{}: not a safetensors file: truncated to {} bytes (the 8-byte header length is missing)",
        file, file_size));
  std::uint64_t n = 0;
  std::memcpy(&n, first_bytes.data(), 8);
  if (n > kSafetensorsMaxHeaderBytes)
    throw Error(fmt::format("{}: header length {} exceeds the format's limit of {} bytes", file, n,
                            kSafetensorsMaxHeaderBytes));
  if (n > file_size - 8)
    throw Error(fmt::format(
        "{}: header length {} runs past the end of the file ({} bytes): truncated or not a "
        "safetensors file",
        file, n, file_size));
  return n;
}

namespace {

// The header's __metadata__ object: string values only.
void decode_header_metadata(const Json& info, std::string_view file,
                            std::map<std::string, std::string>& metadata) {
  if (!info.is_object())
    throw Error(fmt::format("{}: invalid header: __metadata__ is not an object", file));
  for (const auto& [k, v] : info.items()) {
    if (!v.is_string())
      throw Error(
          fmt::format("{}: invalid header: __metadata__ entry '{}' is not a string", file, k));
    metadata.emplace(k, v.get<std::string>());
  }
}

// One tensor's entry of the header, checked on its own: its fields, its dtype, and a byte range
// that holds dtype x shape.
SafetensorsEntry decode_header_entry(const std::string& name, const Json& info,
                                     std::string_view file) {
  auto bad = [&](std::string_view why) {
    return Error(fmt::format("{}: tensor '{}': {}", file, name, why));
  };
  if (!info.is_object()) throw bad("its entry is not an object");
  const auto dt = info.find("dtype");
  const auto sh = info.find("shape");
  const auto off = info.find("data_offsets");
  if (dt == info.end() || !dt->is_string()) throw bad("missing or invalid \"dtype\"");
  if (sh == info.end()) throw bad("missing \"shape\"");
  if (off == info.end() || !off->is_array() || off->size() != 2 ||
      !(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned())
    throw bad("\"data_offsets\" is not a pair of non-negative integers");
  SafetensorsEntry e;
  e.name = name;
  e.dtype_name = dt->get<std::string>();
  const FormatDType* fd = find_format_dtype(e.dtype_name);
  if (fd == nullptr) throw bad(fmt::format("unknown dtype \"{}\"", e.dtype_name));
  e.dtype = fd->dtype;
  auto shape = shape_of(*sh);
  if (!shape)
    throw bad(fmt::format("\"shape\" is not a list of at most {} non-negative integers",
                          kCheckpointMaxDims));
  e.shape = std::move(*shape);
  e.begin = (*off)[0].get<std::uint64_t>();
  e.end = (*off)[1].get<std::uint64_t>();
  const auto bytes = byte_count(e.shape, fd->bits);
  if (!bytes) throw bad(fmt::format("shape {} overflows its element count", dump_strict(*sh)));
  if (e.end < e.begin)
    throw bad(fmt::format("data_offsets [{}, {}] end before they begin", e.begin, e.end));
  if (e.end - e.begin != *bytes)
    throw bad(fmt::format("data_offsets [{}, {}] hold {} bytes, but {} x {} needs {}", e.begin,
                          e.end, e.end - e.begin, e.dtype_name, dump_strict(*sh), *bytes));
  return e;
}

// Sorts the entries by offset and checks that they cover the data buffer from 0 to its end, with
// no hole or overlap.
void check_data_coverage(SafetensorsHeader& h, std::string_view file) {
  std::sort(h.entries.begin(), h.entries.end(), [](const auto& a, const auto& b) {
    return std::pair(a.begin, a.end) < std::pair(b.begin, b.end);
  });
  std::uint64_t at = 0;
  const SafetensorsEntry* prev = nullptr;
  for (const auto& e : h.entries) {
    if (e.end > h.data_bytes)
      throw Error(fmt::format(
          "{}: tensor '{}': data_offsets [{}, {}] run past the end of the file (its data buffer "
          "holds {} bytes): truncated",
          file, e.name, e.begin, e.end, h.data_bytes));
    if (e.begin < at)
      throw Error(fmt::format("{}: tensor '{}': data_offsets [{}, {}] overlap tensor '{}'", file,
                              e.name, e.begin, e.end, prev != nullptr ? prev->name : ""));
    if (e.begin > at)
      throw Error(fmt::format("{}: tensor '{}': data_offsets [{}, {}] leave a hole of {} bytes {}",
                              file, e.name, e.begin, e.end, e.begin - at,
                              prev != nullptr ? fmt::format("after tensor '{}'", prev->name)
                                              : std::string("at the start of the data")));
    at = e.end;
    prev = &e;
  }
  if (at != h.data_bytes)
    throw Error(fmt::format(
        "{}: the tensors end at byte {} of the data buffer, but the file holds {} bytes after "
        "the header ({} trailing bytes)",
        file, at, h.data_bytes, h.data_bytes - at));
}

}  // namespace

SafetensorsHeader decode_safetensors_header(std::span<const std::byte> json,
                                            std::uint64_t file_size, std::string_view file) {
  const std::string_view text(reinterpret_cast<const char*>(json.data()), json.size());
  if (text.empty() || text.front() != '{')
    throw Error(fmt::format("{}: invalid header: it does not begin with '{{'", file));
  std::vector<std::string> order;
  const Json j = parse_checked(text, 3, file, "header", order);
  if (!j.is_object()) throw Error(fmt::format("{}: invalid header: not a JSON object", file));

  SafetensorsHeader h;
  h.data_start = 8 + json.size();
  if (file_size < h.data_start)
    throw Error(fmt::format("{}: truncated: the header ends past the end of the file", file));
  h.data_bytes = file_size - h.data_start;
  h.entries.reserve(j.size());
  for (const auto& [name, info] : j.items()) {
    if (name == "__metadata__")
      decode_header_metadata(info, file, h.metadata);
    else
      h.entries.push_back(decode_header_entry(name, info, file));
  }
  check_data_coverage(h, file);
  return h;
}

EncodedHeader encode_safetensors_header(std::span<const PlannedTensor> tensors,
                                        const std::map<std::string, std::string>& metadata) {
  // Written out directly (the reference's layout: __metadata__ first, then each tensor's dtype,
  // shape and data_offsets, no spaces) instead of through a JSON object, which would sort names.
  EncodedHeader out;
  std::string text = "{";
  if (!metadata.empty()) {
    text += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : metadata) {
      if (!first) text += ',';
      first = false;
      text += json_string(k, false) + ':' + json_string(v, false);
    }
    text += '}';
  }
  out.begin.reserve(tensors.size());
  std::set<std::string_view> names;
  std::uint64_t at = 0;
  for (const auto& t : tensors) {
    const auto dname = safetensors_dtype_name(t.dtype);
    if (!dname)
      throw Error(fmt::format(
          "tensor '{}': safetensors has no {} dtype (save its real and imaginary parts as float64 "
          "leaves, convert it to complex64, or use save_memmap)",
          t.name, name(t.dtype)));
    if (!names.insert(t.name).second || t.name == "__metadata__")
      throw Error(fmt::format("two tensors would be named '{}' in the file", t.name));
    const auto bytes = byte_count(t.shape, static_cast<unsigned>(itemsize(t.dtype) * 8));
    if (!bytes) throw Error(fmt::format("tensor '{}': its size overflows", t.name));
    out.begin.push_back(at);
    if (text.size() > 1) text += ',';
    text +=
        fmt::format("{}:{{\"dtype\":\"{}\",\"shape\":{},\"data_offsets\":[{},{}]}}",
                    json_string(t.name, false), *dname, json_shape(t.shape, ","), at, at + *bytes);
    at += *bytes;
    if (text.size() > kSafetensorsMaxHeaderBytes) break;  // reported below
  }
  text += '}';
  out.data_bytes = at;
  text.resize((text.size() + 7) / 8 * 8, ' ');
  if (text.size() > kSafetensorsMaxHeaderBytes)
    throw Error(fmt::format("the header would take more than the format's limit of {} bytes",
                            kSafetensorsMaxHeaderBytes));
  const std::uint64_t n = text.size();
  out.bytes.resize(8 + text.size());
  std::memcpy(out.bytes.data(), &n, 8);
  std::memcpy(out.bytes.data() + 8, text.data(), text.size());
  return out;
}

// ---- the structure record --------------------------------------------------------------------

std::string encode_structure(const DictStructure& s) {
  Json j = Json::object();
  j["version"] = s.version;
  Json keys = Json::object();
  for (const auto& [flat, key] : s.keys) keys[flat] = key;
  j["keys"] = std::move(keys);
  Json dicts = Json::array();
  for (const auto& [key, batch] : s.dicts) dicts.push_back(Json::array({key, batch}));
  j["dicts"] = std::move(dicts);
  try {
    return dump_strict(j);
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("a key is not valid UTF-8: {}", e.what()));
  }
}

DictStructure decode_structure(std::string_view json, std::string_view file) {
  std::vector<std::string> order;
  const Json j = parse_checked(json, 4, file,
                               fmt::format("__metadata__ \"{}\"", kStructureMetadataKey), order);
  auto bad = [&](std::string_view why) {
    return Error(
        fmt::format("{}: invalid __metadata__ \"{}\": {}", file, kStructureMetadataKey, why));
  };
  if (!j.is_object()) throw bad("not a JSON object");
  auto parts_of = [&](const Json& p, bool allow_empty) -> KeyPath {
    if (!p.is_array() || p.size() > 1024) throw bad("a key is not a list of names");
    std::vector<std::string> parts;
    for (const auto& n : p) {
      if (!n.is_string() || n.get_ref<const std::string&>().empty())
        throw bad("a key holds a name that is not a non-empty string");
      parts.push_back(n.get<std::string>());
    }
    if (parts.empty() && !allow_empty) throw bad("an empty key");
    return parts;
  };
  DictStructure s;
  if (const auto v = j.find("version"); v != j.end() && v->is_string())
    s.version = v->get<std::string>();
  if (const auto k = j.find("keys"); k != j.end()) {
    if (!k->is_object()) throw bad("\"keys\" is not an object");
    for (const auto& [flat, parts] : k->items()) {
      KeyPath key = parts_of(parts, false);
      if (flat_name(key) != flat)
        throw bad(fmt::format("the key of tensor '{}' does not join to its name", flat));
      s.keys.emplace(flat, std::move(key));
    }
  }
  if (const auto d = j.find("dicts"); d != j.end()) {
    if (!d->is_array()) throw bad("\"dicts\" is not a list");
    for (const auto& e : *d) {
      if (!e.is_array() || e.size() != 2) throw bad("a dict entry is not a [key, batch size] pair");
      KeyPath key = parts_of(e[0], true);
      auto batch = shape_of(e[1]);
      if (!batch) throw bad("a batch size is not a list of non-negative integers");
      s.dicts.emplace_back(std::move(key), std::move(*batch));
    }
  }
  return s;
}

// ---- tensordict's memmap layout --------------------------------------------------------------

std::string torch_dtype_name(DType dtype) { return fmt::format("torch.{}", name(dtype)); }

namespace {

std::optional<DType> dtype_from_torch_name(std::string_view s) {
  if (!s.starts_with("torch.")) return std::nullopt;
  s.remove_prefix(6);
  for (std::size_t k = 0; k < kNumDTypes; ++k)
    if (name(static_cast<DType>(k)) == s) return static_cast<DType>(k);
  return std::nullopt;
}

constexpr std::string_view kTensorDictType = "<class 'tensordict._td.TensorDict'>";

}  // namespace

bool is_memmap_reserved_key(std::string_view key) {
  return key == "shape" || key == "device" || key == "_type";
}

std::string encode_memmap_meta(const MemmapMeta& meta) {
  // Python's json.dumps formatting of _td_memmap.py's dict: the entries in insertion order, then
  // "shape", "device", "_type".
  std::string out = "{";
  for (const auto& e : meta.entries) {
    if (is_memmap_reserved_key(e.key))
      throw Error(fmt::format(
          "key '{}': tensordict's meta.json uses this name for the dict's own field", e.key));
    out += json_string(e.key, true);
    if (e.is_dict) {
      out += R"(: {"type": "TensorDict"}, )";
    } else {
      out +=
          fmt::format(R"(: {{"device": "cpu", "shape": {}, "dtype": "{}", "is_nested": false}}, )",
                      json_shape(e.shape, ", "), torch_dtype_name(e.dtype));
    }
  }
  out += fmt::format(R"("shape": {}, "device": "cpu", "_type": "{}"}})",
                     json_shape(meta.batch, ", "), kTensorDictType);
  return out;
}

MemmapMeta decode_memmap_meta(std::string_view json, std::string_view file) {
  std::vector<std::string> order;
  const Json j = parse_checked(json, 3, file, "meta.json", order);
  if (!j.is_object()) throw Error(fmt::format("{}: invalid meta.json: not a JSON object", file));
  MemmapMeta m;
  if (const auto s = j.find("shape"); s != j.end()) {
    auto batch = shape_of(*s);
    if (!batch)
      throw Error(fmt::format("{}: invalid meta.json: \"shape\" is not a batch size", file));
    m.batch = std::move(*batch);
  }
  for (const std::string& key : order) {
    const Json& info = j.at(key);
    if (is_memmap_reserved_key(key) || !info.is_object()) continue;  // the dict's own fields
    auto bad = [&](std::string_view why) {
      return Error(fmt::format("{}: key '{}': {}", file, key, why));
    };
    if (key.empty()) throw bad("an empty key");
    MemmapEntry e;
    e.key = key;
    if (const auto t = info.find("type"); t != info.end()) {
      if (!t->is_string()) throw bad("\"type\" is not a string");
      const auto& type = t->get_ref<const std::string&>();
      if (type == "NonTensorData" || type == "NonTensorStack") continue;  // not tensors: skipped
      if (type != "TensorDict")
        throw bad(fmt::format("collections of type {} are not supported (only TensorDict)", type));
      e.is_dict = true;
      m.entries.push_back(std::move(e));
      continue;
    }
    const auto dt = info.find("dtype");
    const auto sh = info.find("shape");
    if (dt == info.end() || !dt->is_string()) throw bad("missing or invalid \"dtype\"");
    const auto dtype = dtype_from_torch_name(dt->get_ref<const std::string&>());
    if (!dtype)
      throw bad(fmt::format("dtype {} is not supported", dt->get_ref<const std::string&>()));
    if (const auto n = info.find("is_nested"); n != info.end() && n->is_boolean() && n->get<bool>())
      throw bad("nested (jagged) tensors are not supported");
    if (sh == info.end()) throw bad("missing \"shape\"");
    auto shape = shape_of(*sh);
    if (!shape) throw bad("\"shape\" is not a list of non-negative integers");
    if (!byte_count(*shape, static_cast<unsigned>(itemsize(*dtype) * 8)))
      throw bad(fmt::format("shape {} overflows its element count", dump_strict(*sh)));
    e.dtype = *dtype;
    e.shape = std::move(*shape);
    m.entries.push_back(std::move(e));
  }
  return m;
}

std::string memmap_file_name(std::string_view key) {
  if (key.empty()) return "%";
  if (key == "." || key == "..") {
    std::string out;
    for (std::size_t i = 0; i < key.size(); ++i) out += "%2E";
    return out;
  }
  static constexpr std::string_view kUnsafe = "/<>:\"|?*\\ %";
  std::string out;
  out.reserve(key.size());
  for (const char c : key) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 32 || u == 127 || kUnsafe.find(c) != std::string_view::npos) {
      out += fmt::format("%{:02X}", u);
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace td::detail
