// The umbrella header: everything in namespace td but the diagnostics (tensordict/diagnostics.hpp:
// the bucket plan, the packer's and the storage pool's counters), which are opt-in.
#pragma once

#include "tensordict/checkpoint.hpp"
#include "tensordict/collectives.hpp"
#include "tensordict/dtype.hpp"
#include "tensordict/errors.hpp"
#include "tensordict/flight_recorder.hpp"
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
