// EXPECT-SUCCESS (the control: the same setup compiles a correct tensorclass)
#include <tensordict/tensordict.hpp>

struct Good : td::TensorClass<Good> {
  td::Tensor x;
  TD_TENSORCLASS_FIELDS(Good, x)
};

int main() { return static_cast<int>(Good{}.to_tensordict().keys().size()); }
