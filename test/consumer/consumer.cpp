// A program outside the repository that uses only the public API (DESIGN.md's contract): if it
// compiles and prints "consumer ok" against an installed library, the install is usable.
#include <cstdio>
#include <vector>

#include <tensordict/tensordict.hpp>

int main(int argc, char** argv) {
  td::init_process_group(argc, argv);
  const int world_size = td::get_world_size();

  td::TensorDict d;
  d.set("x", td::Tensor::full<float>({3}, 1.0f));
  d.set(td::Key({"a", "b"}), td::Tensor::full<float>({3}, 1.0f));
  d.all_reduce(td::ReduceOp::SUM, {.bucket_bytes = 1 << 20});

  int bad = 0;
  for (const td::Key& key : {td::Key("x"), td::Key({"a", "b"})}) {
    for (float v : d.get(key).to_vector<float>()) {
      if (v != static_cast<float>(world_size)) {
        ++bad;
      }
    }
  }
  if (bad != 0) {
    std::fprintf(stderr, "consumer: rank %d: %d element(s) differ from the world size %d\n",
                 td::get_rank(), bad, world_size);
  } else if (td::get_rank() == 0) {
    std::printf("consumer ok\n");
  }
  td::destroy_process_group();
  return bad == 0 ? 0 : 1;
}
