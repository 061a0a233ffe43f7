// EXPECT: ignoring return value of .*td::irecv.*nodiscard
// td::irecv's Work thrown away: a silently blocking receive (see discarded_isend.cpp).
#pragma GCC diagnostic error "-Wunused-result"
#include <tensordict/tensordict.hpp>

int main() {
  td::Tensor t = td::Tensor::zeros({4}, td::DType::Float32);
  td::irecv(t, 0);
  return 0;
}
