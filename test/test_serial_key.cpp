// td::Key: printing, parsing, and the dict's messages and prints that use it (no MPI).
#include <catch2/catch.hpp>

#include <sstream>
#include <stdexcept>
#include <string>

#include <tensordict/tensordict.hpp>

using td::Key;
using td::Tensor;
using td::TensorDict;

namespace {
// The message of the td::KeyError that `fn` throws ("" if none).
template <class F>
std::string key_error(F&& fn) {
  try {
    fn();
  } catch (const td::KeyError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("Key::str is unambiguous: names that could be misread are quoted", "[key]") {
  CHECK(Key({"a", "b"}).str() == "a.b");
  CHECK(Key("a.b").str() == "\"a.b\"");
  CHECK(Key({"a.b"}).str() != Key({"a", "b"}).str());
  CHECK(Key({"layer1", "weight"}).str() == "layer1.weight");
  CHECK(Key("x/y").str() == "\"x/y\"");
  CHECK(Key("say \"hi\"").str() == R"("say \"hi\"")");
  CHECK(Key("back\\slash").str() == R"("back\\slash")");
  CHECK(Key("tab\there").str() == R"("tab\there")");
  CHECK(Key("new\nline").str() == R"("new\nline")");
  CHECK(Key(std::string("nul\0x", 5)).str() == R"("nul\x00x")");
  CHECK(Key("bell\x7f").str() == R"("bell\x7f")");
  CHECK(Key("caf\xc3\xa9").str() == "caf\xc3\xa9");  // UTF-8 is printed as is
  CHECK(Key({"a", "b.c", "d"}).str() == "a.\"b.c\".d");
  // an explicit separator: a name containing it is quoted too
  CHECK(Key({"a", "b"}).str("/") == "a/b");
  CHECK(Key({"a::b", "c"}).str("::") == "\"a::b\"::c");
  CHECK(Key({"a", "b"}).str(".") == Key({"a", "b"}).str());
}

TEST_CASE("Key::parse splits at the separator and rejects empty names", "[key]") {
  CHECK(Key::parse("a") == Key("a"));
  CHECK(Key::parse("a.b.c") == Key({"a", "b", "c"}));
  CHECK(Key::parse("a/b.c", '/') == Key({"a", "b.c"}));
  CHECK(Key::parse("layer1.weight").str() == "layer1.weight");
  CHECK(Key::parse("\"a.b\"") == Key({"\"a", "b\""}));  // nothing is unescaped
  for (const char* bad : {"", ".", "a.", ".a", "a..b"}) {
    INFO(bad);
    CHECK_THROWS_AS(Key::parse(bad), std::invalid_argument);
  }
}

TEST_CASE("KeyError says whether a name on the path is absent or a tensor", "[key][tensordict]") {
  TensorDict d;
  d.set("layer0", Tensor::zeros({1}, td::DType::Float32));
  d.set({"layer2", "bias"}, Tensor::zeros({1}, td::DType::Float32));
  const std::string absent = key_error([&] { d.get({"layer1", "weight"}); });
  CHECK(absent == "key 'layer1.weight' not found ('layer1' does not exist)");
  const std::string tensor = key_error([&] { d.get({"layer0", "weight"}); });
  CHECK(tensor == "key 'layer0.weight' not found ('layer0' is a tensor, not a sub-dict)");
  CHECK(key_error([&] { d.get({"layer2", "weight"}); }) == "key 'layer2.weight' not found");
  CHECK(key_error([&] { d.get("nope"); }) == "key 'nope' not found");
  // the same reasons from get_dict, erase and select
  CHECK(key_error([&] {
          d.get_dict({"layer1", "x"});
        }) == "key 'layer1.x' not found ('layer1' does not exist)");
  CHECK(key_error([&] {
          d.get_dict({"layer0", "x"});
        }) == "key 'layer0.x' not found ('layer0' is a tensor, not a sub-dict)");
  CHECK(key_error([&] {
          d.erase({"layer1", "x"});
        }) == "key 'layer1.x' not found ('layer1' does not exist)");
  CHECK(key_error([&] {
          d.erase({"layer0", "x"});
        }) == "key 'layer0.x' not found ('layer0' is a tensor, not a sub-dict)");
  CHECK(key_error([&] {
          d.select({Key({"layer1", "x"})});
        }) == "key 'layer1.x' not found ('layer1' does not exist)");
  CHECK(key_error([&] { d.get_dict("layer0"); }) ==
        "key 'layer0' is a tensor, not a sub-dict (use get)");
  CHECK(key_error([&] {
          d.set({"layer0", "w"}, Tensor::zeros({1}, td::DType::Float32));
        }) == "set('layer0.w'): 'layer0' holds a tensor, not a sub-dict");
  // a name with a dot is quoted in messages: the two keys below read differently
  d.set("a.b", Tensor::zeros({1}, td::DType::Float32));
  CHECK(key_error([&] { d.get({"a", "b"}); }) == "key 'a.b' not found ('a' does not exist)");
  CHECK(key_error([&] {
          d.get({"a.b", "c"});
        }) == "key '\"a.b\".c' not found ('\"a.b\"' is a tensor, not a sub-dict)");
}

TEST_CASE("flatten_keys joins names as they are; messages and prints tell the results apart",
          "[key][tensordict]") {
  TensorDict d;
  d.set({"a", "b"}, Tensor::zeros({1}, td::DType::Float32));
  TensorDict flat = d.flatten_keys();
  CHECK(flat.contains("a.b"));  // one name containing a dot
  CHECK_FALSE(flat.contains({"a", "b"}));
  CHECK(flat.keys()[0].str() == "\"a.b\"");
  CHECK(d.keys(true, true)[0].str() == "a.b");
  CHECK(flat.unflatten_keys() == d);
  // printing a dict names its entries the way messages do
  CHECK(td::to_string(flat) ==
        "TensorDict(\n"
        "    fields={\n"
        "        \"a.b\": Tensor(shape=[1], dtype=float32),\n"
        "    },\n"
        "    batch_size=[])");
  std::ostringstream os;
  os << d;
  CHECK(os.str() ==
        "TensorDict(\n"
        "    fields={\n"
        "        a: TensorDict(\n"
        "            fields={\n"
        "                b: Tensor(shape=[1], dtype=float32),\n"
        "            },\n"
        "            batch_size=[]),\n"
        "    },\n"
        "    batch_size=[])");
}
