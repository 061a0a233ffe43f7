// The td names the MPI test files spell without `td::`.
#pragma once

#include <tensordict/tensordict.hpp>

using td::DType;
using td::Key;
using td::ReduceOp;
using td::Tensor;
using td::TensorDict;
