// The umbrella header: everything in namespace td.
#pragma once

#include "tensordict/bucket_plan.hpp"
#include "tensordict/checkpoint.hpp"
#include "tensordict/collectives.hpp"
#include "tensordict/dtype.hpp"
#include "tensordict/errors.hpp"
#include "tensordict/key.hpp"
#include "tensordict/process_group.hpp"
#include "tensordict/reducer.hpp"
#include "tensordict/tensor.hpp"
#include "tensordict/tensor_dict.hpp"
#include "tensordict/tensorclass.hpp"
#include "tensordict/transport.hpp"
#include "tensordict/version.hpp"
#include "tensordict/work.hpp"

/// tensordict-mpi: nested dicts of tensors and their MPI collectives.
namespace td {}
