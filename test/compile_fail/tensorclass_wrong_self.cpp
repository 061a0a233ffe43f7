// EXPECT: TD_TENSORCLASS_FIELDS\(Type, ...\) must name the struct it is declared in
#include <tensordict/tensordict.hpp>

struct Other : td::TensorClass<Other> {
  td::Tensor y;
  TD_TENSORCLASS_FIELDS(Other, y)
};

struct Mine : td::TensorClass<Mine> {
  td::Tensor x;
  TD_TENSORCLASS_FIELDS(Other, y)  // names another struct
};

int main() { return static_cast<int>(Mine{}.to_tensordict().keys().size()); }
