// Checkpoints that Python opens: safetensors files (safetensors.torch.load_file) and tensordict's
// memmap directories (TensorDict.load_memmap), written atomically, by one process or in parallel
// by a group over MPI-IO. See docs/checkpoint.md.
#pragma once

#include <chrono>
#include <filesystem>
#include <optional>

#include "tensordict/export.hpp"
#include "tensordict/process_group.hpp"
#include "tensordict/tensor_dict.hpp"
#include "tensordict/tensorclass.hpp"

namespace td {

/// Options of the checkpoint calls.
struct FileOptions {
  /// Set: the call is collective over the group (every rank calls; MPI-IO). Unset: this process
  /// alone, with POSIX I/O (no MPI needed).
  std::optional<ProcessGroup> group = std::nullopt;
  /// Limit of the group's rendezvous and data phase; default: InitOptions::timeout.
  std::optional<std::chrono::milliseconds> timeout = std::nullopt;
};

/// Writes `dict` as a safetensors file (nested keys joined by '.'); with a group, the union of
/// every rank's dict, each shared key written once by its holders together.
TD_API void save_safetensors(const TensorDict& dict, const std::filesystem::path& file,
                             const FileOptions& opts = {});
/// Reads every tensor of a safetensors file into a consolidated dict.
TD_API TensorDict load_safetensors(const std::filesystem::path& file, const FileOptions& opts = {});
/// Reads only `like`'s keys, checking their dtypes and shapes (td::LayoutMismatchError).
TD_API TensorDict load_safetensors(const std::filesystem::path& file, const TensorDict& like,
                                   const FileOptions& opts = {});
/// Writes `dict` as tensordict's memmap directory (TensorDict.memmap's layout).
TD_API void save_memmap(const TensorDict& dict, const std::filesystem::path& dir,
                        const FileOptions& opts = {});
/// Reads a memmap directory written by save_memmap or by Python's TensorDict.memmap.
TD_API TensorDict load_memmap(const std::filesystem::path& dir, const FileOptions& opts = {});

/// save_safetensors of a tensorclass's fields.
template <TensorClassType T>
void save_safetensors(const T& value, const std::filesystem::path& file,
                      const FileOptions& opts = {}) {
  save_safetensors(value.to_tensordict(), file, opts);
}
/// A tensorclass from a safetensors file, reading the fields `like` has (dtypes, shapes checked).
template <TensorClassType T>
T load_safetensors(const std::filesystem::path& file, const T& like, const FileOptions& opts = {}) {
  return T::from_tensordict(load_safetensors(file, like.to_tensordict(), opts));
}
/// A tensorclass from a safetensors file: `td::load_safetensors<Batch>(file)`.
template <TensorClassType T>
T load_safetensors(const std::filesystem::path& file, const FileOptions& opts = {}) {
  return T::from_tensordict(load_safetensors(file, opts));
}
/// save_memmap of a tensorclass's fields.
template <TensorClassType T>
void save_memmap(const T& value, const std::filesystem::path& dir, const FileOptions& opts = {}) {
  save_memmap(value.to_tensordict(), dir, opts);
}
/// A tensorclass from a memmap directory: `td::load_memmap<Batch>(dir)`.
template <TensorClassType T>
T load_memmap(const std::filesystem::path& dir, const FileOptions& opts = {}) {
  return T::from_tensordict(load_memmap(dir, opts));
}

}  // namespace td
