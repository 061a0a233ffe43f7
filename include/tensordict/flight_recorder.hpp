// The flight recorder: the last calls of this process, for hang diagnosis (docs/reliability.md).
#pragma once

#include <filesystem>

#include "tensordict/export.hpp"

namespace td {

/// Writes this process's flight recorder (its last TD_FLIGHT_RECORDER calls on every group, with
/// their sequence numbers and times, and the calls its threads are inside) to `file` as JSON,
/// the format `td-flight` reads. Throws td::Error when the file cannot be written.
TD_API void dump_flight_recorder(const std::filesystem::path& file);

}  // namespace td
