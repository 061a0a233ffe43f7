// Library functions the white-box tests call that no header under src/ declares: each is defined
// in the file named beside it, and its declaration belongs in that layer's header (a test that
// links td_objects reaches it either way; a mismatch here is a link error).
#pragma once

#include <optional>
#include <string_view>

namespace td::detail {

/// src/runtime/process_group.cpp: whether the progress thread runs by default, from the world's
/// size, the ranks on this host, MPI_Get_library_version's text and TD_PROGRESS_THREAD.
bool progress_thread_on(int world_size, int ranks_on_host, std::string_view library_version,
                        std::optional<bool> setting);

}  // namespace td::detail
