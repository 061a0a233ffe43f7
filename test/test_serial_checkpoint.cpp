// Checkpoint files without MPI: files the reference implementation of safetensors writes, round
// trips of every dtype and of the dict's structure, the loader's rejection of corrupted files
// (each error names the file, the tensor and the problem), atomic saves, and tensordict's memmap
// layout field by field.
//
// Reference sources read (for the formats; no code copied):
//   huggingface/safetensors  safetensors/src/tensor.rs  at 24b0b2857fef49be734b9ab72ce97c09bb25f5b9
//     (the byte vectors of test/support/safetensors_reference.hpp are the expected outputs of its
//     test_serialization and test_empty, i.e. what its serialize() writes)
//   pytorch/tensordict  tensordict/_td.py (_memmap_, _load_memmap), tensordict/_td_memmap.py
//     (_save_metadata, _update_metadata), tensordict/_utils_key_json.py
//     (_encode_key_for_filesystem)  at a1a061e3dd4b4c892925525a726a72c9eef9a0cc
//     (test/data/tensordict_mmap_example is its test/artifacts/mmap_example, written by
//     TensorDict.memmap)
// The format code's own tests (the header codec, the key encoding) are white-box:
// test/internal/test_internal_checkpoint_format.cpp.
#include <catch2/catch.hpp>

#include <unistd.h>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <tensordict/tensordict.hpp>

#include "support/safetensors_reference.hpp"

namespace fs = std::filesystem;
using Catch::Matchers::Contains;
using td::DType;
using td::Key;
using td::Tensor;
using td::TensorDict;
using tdtest::kReferenceAttn;
using tdtest::kReferenceEmptyWithMetadata;
using tdtest::kReferenceFp4;

namespace {

// A fresh directory per test case under the build tree's temporary directory.
struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / fmt::format("td-ckpt-{}-{}", ::getpid(), counter()++);
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  static unsigned& counter() {
    static unsigned c = 0;
    return c;
  }
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(path)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }
};

void write_bytes(const fs::path& p, const std::vector<std::uint8_t>& b) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}
std::vector<std::uint8_t> read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// A safetensors file from a header text and data bytes (length prefix added, no padding).
std::vector<std::uint8_t> file_of(const std::string& header, std::size_t data_bytes) {
  std::vector<std::uint8_t> out(8 + header.size() + data_bytes, 0);
  const std::uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  std::memcpy(out.data() + 8, header.data(), header.size());
  return out;
}

TensorDict every_dtype() {
  TensorDict d;
  d.set("bool", Tensor::from_vector<bool>({true, false, true}));
  d.set("u8", Tensor::from_vector<std::uint8_t>({0, 255, 7}));
  d.set("i8", Tensor::from_vector<std::int8_t>({-128, 127, 0}));
  d.set("i16", Tensor::from_vector<std::int16_t>({-30000, 2, 3}));
  d.set("i32", Tensor::from_vector<std::int32_t>({1, -2, 3, 4}, {2, 2}));
  d.set("i64", Tensor::from_vector<std::int64_t>({INT64_MIN, INT64_MAX}));
  d.set("f16", Tensor::full<Eigen::half>({2, 3}, Eigen::half(0.5F)));
  d.set("bf16", Tensor::full<Eigen::bfloat16>({3}, Eigen::bfloat16(-2.0F)));
  d.set("f32", Tensor::from_vector<float>({1.5F, -0.25F, 3.0F}));
  d.set("f64", Tensor::from_vector<double>({1e300, -1e-300}));
  d.set("c64", Tensor::from_vector<std::complex<float>>({{1, 2}, {-3, 4}}));
  return d;
}

// A dict with nested keys, a key part containing '.', batch sizes, a strided view, 0-d and
// zero-size leaves, an empty sub-dict, and two keys sharing storage.
TensorDict structured() {
  TensorDict d;
  d.set("zero_d", Tensor::full<std::int64_t>({}, 42));
  TensorDict layer(td::Shape{4, 3});
  Tensor w = Tensor::from_vector<float>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {3, 4});
  layer.set("w_t", w.transpose(0, 1));  // strided: written in C order of its logical values
  layer.set("alias", w.transpose(0, 1));
  layer.set("empty", Tensor::empty({4, 3, 0}, DType::Int32));
  d.set("layer", std::move(layer));
  d.set(Key({"model.v1", "bias"}), Tensor::full<double>({4, 2}, 0.125));
  d.set("nothing", TensorDict(td::Shape{4, 2}));
  d.set(Key({"meta", "step"}), Tensor::full<std::int64_t>({4}, 7));
  return d;
}

bool same_batch_sizes(const TensorDict& a, const TensorDict& b) {
  if (a.batch_size() != b.batch_size()) return false;
  for (const Key& k : a.keys(true))
    if (a.is_dict(k) && (!b.is_dict(k) || a.get_dict(k).batch_size() != b.get_dict(k).batch_size()))
      return false;
  return true;
}

}  // namespace

TEST_CASE("safetensors: files written by the reference implementation load", "[safetensors]") {
  TempDir dir;
  const fs::path f = dir.path / "reference.safetensors";
  write_bytes(f, kReferenceAttn);
  // Without our metadata, nested keys come from splitting the names at '.'
  // (TensorDict.unflatten_keys(".") in Python).
  const TensorDict d = td::load_safetensors(f);
  const Tensor& t = d.get(Key({"attn", "0"}));
  CHECK(t.dtype() == DType::Float32);
  CHECK(t.shape() == td::Shape{1, 2, 3});
  CHECK(t.to_vector<float>() == std::vector<float>{0, 1, 2, 3, 4, 5});

  write_bytes(f, kReferenceEmptyWithMetadata);
  CHECK(td::load_safetensors(f).empty());

  write_bytes(f, kReferenceFp4);
  CHECK_THROWS_WITH(td::load_safetensors(f), Contains(f.string()) && Contains("'attn.0'") &&
                                                 Contains("F4") && Contains("not supported"));
}

TEST_CASE("safetensors: every dtype round-trips, and the file is a plain safetensors file",
          "[safetensors]") {
  TempDir dir;
  const fs::path f = dir.path / "dtypes.safetensors";
  const TensorDict d = every_dtype();
  td::save_safetensors(d, f);
  const TensorDict back = td::load_safetensors(f);
  CHECK(back.equal(d));
  CHECK(back.is_consolidated());
  // The header as a Python reader sees it: flat names, safetensors dtype names, a string-only
  // __metadata__.
  const auto bytes = read_bytes(f);
  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  CHECK(n % 8 == 0);
  const auto j = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<long>(n));
  CHECK(j["f32"]["dtype"] == "F32");
  CHECK(j["bf16"]["dtype"] == "BF16");
  CHECK(j["c64"]["dtype"] == "C64");
  CHECK(j["bool"]["dtype"] == "BOOL");
  CHECK(j["i32"]["shape"] == nlohmann::json::array({2, 2}));
  CHECK(j["__metadata__"]["format"] == "pt");
  for (const auto& [k, v] : j["__metadata__"].items()) CHECK(v.is_string());
}

TEST_CASE(
    "safetensors: nested keys, dots in names, batch sizes, views and empty leaves "
    "round-trip exactly",
    "[safetensors]") {
  TempDir dir;
  const fs::path f = dir.path / "structured.safetensors";
  const TensorDict d = structured();
  td::save_safetensors(d, f);
  const TensorDict back = td::load_safetensors(f);
  CHECK(back.equal(d));
  CHECK(same_batch_sizes(back, d));
  CHECK(back.contains("nothing"));  // the empty sub-dict
  CHECK(back.get(Key({"layer", "w_t"})).to_vector<float>() ==
        d.get(Key({"layer", "w_t"})).to_vector<float>());
  CHECK(back.contains(Key({"model.v1", "bias"})));  // not {"model", "v1", "bias"}
  // The flat names Python sees.
  const auto bytes = read_bytes(f);
  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  const auto j = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<long>(n));
  CHECK(j.contains("layer.w_t"));
  CHECK(j.contains("model.v1.bias"));
  CHECK(j["layer.empty"]["shape"] == nlohmann::json::array({4, 3, 0}));
}

TEST_CASE("safetensors: like loads only its keys and checks dtypes and shapes", "[safetensors]") {
  TempDir dir;
  const fs::path f = dir.path / "model.safetensors";
  td::save_safetensors(structured(), f);
  TensorDict like(td::Shape{4});
  like.set(Key({"meta", "step"}), Tensor::zeros({4}, DType::Int64));
  const TensorDict got = td::load_safetensors(f, like);
  CHECK(got.keys(true, true).size() == 1);
  CHECK(got.get(Key({"meta", "step"})).to_vector<std::int64_t>() ==
        std::vector<std::int64_t>{7, 7, 7, 7});

  TensorDict wrong_dtype(td::Shape{4});
  wrong_dtype.set(Key({"meta", "step"}), Tensor::zeros({4}, DType::Int32));
  CHECK_THROWS_AS(td::load_safetensors(f, wrong_dtype), td::LayoutMismatchError);
  CHECK_THROWS_WITH(td::load_safetensors(f, wrong_dtype),
                    Contains("'meta.step'") && Contains("int64[4]") && Contains("int32[4]"));
  TensorDict missing;
  missing.set("absent", Tensor::zeros({1}, DType::Float32));
  CHECK_THROWS_AS(td::load_safetensors(f, missing), td::KeyError);
}

TEST_CASE("safetensors: complex128 and sparse leaves are clear errors, and nothing is written",
          "[safetensors][errors]") {
  TempDir dir;
  const fs::path f = dir.path / "bad.safetensors";
  TensorDict c;
  c.set("z", Tensor::from_vector<std::complex<double>>({{1, 2}}));
  CHECK_THROWS_WITH(td::save_safetensors(c, f), Contains("'z'") && Contains("complex128"));
  TensorDict s;
  s.set("sp", Tensor::sparse_coo(Tensor::from_vector<std::int64_t>({0, 1}, {1, 2}),
                                 Tensor::from_vector<float>({1, 2}), {3}));
  CHECK_THROWS_WITH(td::save_safetensors(s, f), Contains("'sp'") && Contains("sparse"));
  CHECK(dir.entries().empty());
  // Two keys with the same flat name.
  TensorDict clash;
  clash.set(Key({"a", "b"}), Tensor::zeros({1}, DType::Float32));
  clash.set(Key({"a.b"}), Tensor::zeros({1}, DType::Float32));
  CHECK_THROWS_WITH(td::save_safetensors(clash, f), Contains("'a.b'") && Contains("both"));
  CHECK(dir.entries().empty());
}

TEST_CASE("safetensors: a failed save keeps the previous file and leaves no temporary file",
          "[safetensors][errors]") {
  TempDir dir;
  const fs::path f = dir.path / "ckpt.safetensors";
  td::save_safetensors(every_dtype(), f);
  const auto before = read_bytes(f);
  TensorDict bad = every_dtype();
  bad.set("z", Tensor::from_vector<std::complex<double>>({{1, 2}}));
  CHECK_THROWS(td::save_safetensors(bad, f));
  CHECK(read_bytes(f) == before);
  CHECK(dir.entries() == std::vector<std::string>{"ckpt.safetensors"});
  // A target that cannot be replaced (a directory): the data was written and flushed, the
  // rename fails, the temporary file is removed.
  const fs::path d = dir.path / "a_directory";
  fs::create_directories(d / "keep");
  CHECK_THROWS_WITH(td::save_safetensors(every_dtype(), d), Contains("rename"));
  CHECK(fs::is_directory(d / "keep"));
  CHECK(dir.entries() == std::vector<std::string>{"a_directory", "ckpt.safetensors"});
  // A successful save replaces the file.
  td::save_safetensors(structured(), f);
  CHECK(td::load_safetensors(f).equal(structured()));
}

TEST_CASE("safetensors: the loader rejects corrupted files, naming file, tensor and problem",
          "[safetensors][errors]") {
  TempDir dir;
  const fs::path f = dir.path / "corrupt.safetensors";
  const std::string file = f.string();
  auto rejects = [&](const std::vector<std::uint8_t>& bytes) {
    write_bytes(f, bytes);
    try {
      (void)td::load_safetensors(f);
    } catch (const td::Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const std::string entry = R"("t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";

  CHECK_THAT(rejects({1, 2, 3}), Contains(file) && Contains("truncated"));
  auto huge = file_of("{}", 0);
  const std::uint64_t too_long = 200'000'000;
  std::memcpy(huge.data(), &too_long, 8);
  CHECK_THAT(rejects(huge), Contains(file) && Contains("exceeds") && Contains("100000000"));
  auto beyond = file_of("{}", 0);
  const std::uint64_t past = 4096;
  std::memcpy(beyond.data(), &past, 8);
  CHECK_THAT(rejects(beyond), Contains(file) && Contains("runs past the end"));
  CHECK_THAT(rejects(file_of("{" + entry, 8)), Contains(file) && Contains("JSON"));
  CHECK_THAT(rejects(file_of(" {" + entry + "}", 8)), Contains("does not begin with '{'"));
  CHECK_THAT(rejects(file_of("[1,2]   ", 0)), Contains("does not begin"));
  const std::string bad_utf8 =
      std::string(R"({"t)") + '\xff' + R"(":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  CHECK_THAT(rejects(file_of(bad_utf8, 8)), Contains(file) && Contains("UTF-8"));
  CHECK_THAT(rejects(file_of(R"({"t":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", 8)),
             Contains(file) && Contains("'t'") && Contains("unknown dtype \"F33\""));
  CHECK_THAT(rejects(file_of(R"({"t":{"dtype":"U16","shape":[4],"data_offsets":[0,8]}})", 8)),
             Contains(file) && Contains("'t'") && Contains("U16") && Contains("not supported"));
  CHECK_THAT(rejects(file_of(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("u":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                             12)),
             Contains(file) && Contains("'u'") && Contains("overlap") && Contains("'t'"));
  CHECK_THAT(rejects(file_of(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("u":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})",
                             20)),
             Contains(file) && Contains("'u'") && Contains("hole of 4 bytes"));
  CHECK_THAT(rejects(file_of(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8)),
             Contains(file) && Contains("'t'") && Contains("needs 12"));
  CHECK_THAT(rejects(file_of("{" + entry + "," + entry + "}", 8)),
             Contains(file) && Contains("'t'") && Contains("twice"));
  CHECK_THAT(
      rejects(file_of(
          R"({"t":{"dtype":"F64","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}})", 8)),
      Contains(file) && Contains("'t'") && Contains("overflow"));
  CHECK_THAT(rejects(file_of("{" + entry + "}", 12)),
             Contains(file) && Contains("4 trailing bytes"));
  CHECK_THAT(rejects(file_of("{" + entry + "}", 5)),
             Contains(file) && Contains("'t'") && Contains("truncated"));
  CHECK_THAT(rejects(file_of(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8)),
             Contains("'t'") && Contains("shape"));
  CHECK_THAT(rejects(file_of(R"({"__metadata__":{"k":1}})", 0)), Contains("__metadata__"));
  // The accepted control: the same entry, well formed.
  CHECK(rejects(file_of("{" + entry + "}", 8)) == "accepted");
}

TEST_CASE("memmap: files match tensordict's layout field by field", "[memmap]") {
  TempDir dir;
  const fs::path root = dir.path / "td";
  TensorDict d(td::Shape{2});
  d.set("obs", Tensor::from_vector<float>({1, 2, 3, 4}, {2, 2}));
  d.set("a b/c", Tensor::from_vector<std::int64_t>({5, 6}));  // encoded: a%20b%2Fc
  d.set("none", Tensor::empty({2, 0}, DType::Float64));       // no file, like tensordict
  TensorDict sub(td::Shape{2, 1});
  sub.set("bf", Tensor::full<Eigen::bfloat16>({2, 1}, Eigen::bfloat16(1.0F)));
  d.set("nested", std::move(sub));
  td::save_memmap(d, root);

  // _save_metadata / _update_metadata: leaves {device, shape, dtype, is_nested}, sub-dicts
  // {type}, then the dict's shape, device and _type.
  const auto meta = nlohmann::ordered_json::parse(read_bytes(root / "meta.json"));
  CHECK(meta["obs"] == nlohmann::ordered_json::parse(
                           R"({"device": "cpu", "shape": [2, 2], "dtype": "torch.float32", )"
                           R"("is_nested": false})"));
  CHECK(meta["a b/c"]["dtype"] == "torch.int64");
  CHECK(meta["none"]["shape"] == nlohmann::json::array({2, 0}));
  CHECK(meta["nested"] == nlohmann::ordered_json::parse(R"({"type": "TensorDict"})"));
  CHECK(meta["shape"] == nlohmann::json::array({2}));
  CHECK(meta["device"] == "cpu");
  CHECK(meta["_type"] == "<class 'tensordict._td.TensorDict'>");
  // Python's json.dumps spacing, as tensordict's own files have.
  const auto text = read_bytes(root / "meta.json");
  CHECK(std::string(text.begin(), text.end()).find(R"("shape": [2], "device": "cpu")") !=
        std::string::npos);
  const auto nested = nlohmann::ordered_json::parse(read_bytes(root / "nested" / "meta.json"));
  CHECK(nested["bf"]["dtype"] == "torch.bfloat16");
  CHECK(nested["shape"] == nlohmann::json::array({2, 1}));
  // The raw files: C-order bytes, names encoded like _encode_key_for_filesystem.
  const auto obs = read_bytes(root / "obs.memmap");
  REQUIRE(obs.size() == 16);
  float first = 0;
  std::memcpy(&first, obs.data(), 4);
  CHECK(first == 1.0F);
  CHECK(fs::file_size(root / "a%20b%2Fc.memmap") == 16);
  CHECK(!fs::exists(root / "none.memmap"));
  CHECK(fs::file_size(root / "nested" / "bf.memmap") == 4);

  const TensorDict back = td::load_memmap(root);
  CHECK(back.equal(d));
  CHECK(same_batch_sizes(back, d));
  CHECK(back.is_consolidated());
  // Saving again replaces the directory as a whole.
  TensorDict small;
  small.set("x", Tensor::full<float>({1}, 3.0F));
  td::save_memmap(small, root);
  CHECK(td::load_memmap(root).equal(small));
  CHECK(!fs::exists(root / "obs.memmap"));
  CHECK(dir.entries() == std::vector<std::string>{"td"});
}

TEST_CASE("memmap: a directory written by Python tensordict loads", "[memmap]") {
  const fs::path root = fs::path(TD_TEST_DATA_DIR) / "tensordict_mmap_example";
  const TensorDict d = td::load_memmap(root);
  CHECK(d.batch_size() == td::Shape{2, 1});
  CHECK(d.get_dict("nested").batch_size() == td::Shape{2, 1});
  CHECK(d.get(Key({"nested", "int64"})).to_vector<std::int64_t>() ==
        std::vector<std::int64_t>{1, 2});
  const Tensor& bf = d.get(Key({"nested", "bfloat16"}));
  CHECK(bf.dtype() == DType::BFloat16);
  CHECK(static_cast<float>(bf.to_vector<Eigen::bfloat16>()[1]) == 1.0F);
  CHECK(!d.contains(Key({"nested", "string"})));  // NonTensorData: skipped
}

TEST_CASE("memmap: rejections name the directory, the key and the problem", "[memmap][errors]") {
  TempDir dir;
  const fs::path root = dir.path / "td";
  TensorDict d;
  d.set("shape", Tensor::zeros({1}, DType::Float32));
  CHECK_THROWS_WITH(td::save_memmap(d, root), Contains("'shape'") && Contains("meta.json"));
  CHECK(dir.entries().empty());

  TensorDict ok;
  ok.set("x", Tensor::zeros({4}, DType::Float32));
  td::save_memmap(ok, root);
  fs::resize_file(root / "x.memmap", 8);
  CHECK_THROWS_WITH(td::load_memmap(root), Contains("'x'") && Contains("truncated"));
  fs::remove(root / "x.memmap");
  CHECK_THROWS_WITH(td::load_memmap(root), Contains("'x'") && Contains("missing"));
  write_bytes(root / "meta.json", {'{', '"', 'x', '"', ':'});
  CHECK_THROWS_WITH(td::load_memmap(root), Contains("meta.json") && Contains("JSON"));
  const std::string unknown = R"({"x": {"device": "cpu", "shape": [4], "dtype": "torch.uint16"}})";
  write_bytes(root / "meta.json", {unknown.begin(), unknown.end()});
  CHECK_THROWS_WITH(td::load_memmap(root), Contains("'x'") && Contains("torch.uint16"));
}

namespace {
struct Policy : td::TensorClass<Policy> {
  Tensor weight;
  Tensor bias;
  TD_TENSORCLASS_FIELDS(Policy, weight, bias)
};
struct Agent : td::TensorClass<Agent> {
  Policy policy;
  Tensor steps;
  TD_TENSORCLASS_FIELDS(Agent, policy, steps)
};
}  // namespace

TEST_CASE("tensorclasses save and load the same way", "[safetensors][memmap][tensorclass]") {
  TempDir dir;
  Agent a;
  a.policy.weight = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  a.policy.bias = Tensor::from_vector<float>({0.5F, -0.5F});
  a.steps = Tensor::full<std::int64_t>({}, 1000);
  td::save_safetensors(a, dir.path / "agent.safetensors");
  const Agent b = td::load_safetensors<Agent>(dir.path / "agent.safetensors");
  CHECK(b.equal(a));
  const Agent c = td::load_safetensors(dir.path / "agent.safetensors", a);
  CHECK(c.equal(a));
  td::save_memmap(a, dir.path / "agent");
  CHECK(td::load_memmap<Agent>(dir.path / "agent").equal(a));
}
