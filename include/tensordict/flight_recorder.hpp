// The flight recorder: the last calls of this process, for hang diagnosis (docs/reliability.md).
#pragma once

#include <filesystem>

#include "tensordict/export.hpp"

namespace td {

/// Writes this process's flight recorder (its last TD_FLIGHT_RECORDER calls on every group, with
/// their sequence numbers and times, and the calls its threads are inside) to `file` as JSON,
/// the format `td-flight` reads. Throws td::Error when the file cannot be written.
///
/// With TD_FLIGHT_RECORDER_DIR set, the library also writes `DIR/rank-R.json` itself (R: the
/// world rank), once, at the first incident (a timeout, td::abort, an uncaught exception). A dump
/// to any other file leaves that one to come; a dump to that very file counts as it: the incident
/// then leaves the file as the program wrote it.
TD_API void dump_flight_recorder(const std::filesystem::path& file);

}  // namespace td
