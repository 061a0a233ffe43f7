// EXPECT: field listed in TD_TENSORCLASS_FIELDS must be a \(non-const\) td::Tensor
#include <string>

#include <tensordict/tensordict.hpp>

struct Bad : td::TensorClass<Bad> {
  td::Tensor x;
  std::string name;  // not a tensor
  TD_TENSORCLASS_FIELDS(Bad, x, name)
};

int main() { return static_cast<int>(Bad{}.to_tensordict().keys().size()); }
