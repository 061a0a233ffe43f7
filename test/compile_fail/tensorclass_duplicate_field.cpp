// EXPECT: a field is listed twice in TD_TENSORCLASS_FIELDS
#include <tensordict/tensordict.hpp>

struct Twice : td::TensorClass<Twice> {
  td::Tensor x;
  TD_TENSORCLASS_FIELDS(Twice, x, x)
};

int main() { return static_cast<int>(Twice{}.to_tensordict().keys().size()); }
