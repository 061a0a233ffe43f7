// EXPECT: ignoring return value of .*TensorDict::isend.*nodiscard
// The Works of an async call thrown away make the call silently blocking (the destructor waits),
// so TensorDict::isend is [[nodiscard]]. The warning is an error here, so the build fails when
// (and only when) it fires.
#pragma GCC diagnostic error "-Wunused-result"
#include <tensordict/tensordict.hpp>

int main() {
  td::TensorDict d;
  d.isend(1);
  return 0;
}
