// File I/O of the checkpoints (ops/checkpoint.cpp): byte ranges between memory and a file, one
// process with POSIX calls or a whole group with collective MPI-IO, and what an atomic save
// needs (a temporary name beside the target, fsync, rename). Every MPI-IO call of the library is
// here, behind this narrow interface, so the executor can take it over.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <mpi.h>

#include "runtime/deadline.hpp"
#include "runtime/group_state.hpp"

namespace td::detail {

/// One run of bytes: `size` bytes at `offset` in the file, at `data` in memory (read from for a
/// write, written to by a read).
struct FileRange {
  std::uint64_t offset = 0;
  std::byte* data = nullptr;
  std::uint64_t size = 0;
};

/// `blocks` dealt, in order, into rounds of at most `round_bytes` bytes each (a block is cut where
/// a round ends; a block adjacent to the previous one both in the file and in memory joins it):
/// what one collective MPI-IO call of CollectiveFile moves, so no count reaches INT_MAX.
std::vector<std::vector<FileRange>> split_rounds(const std::vector<FileRange>& blocks,
                                                 std::uint64_t round_bytes);

/// A file of this process (POSIX). Writes and reads coalesce small adjacent ranges through one
/// staging buffer, so many small leaves cost few system calls.
class LocalFile {
 public:
  /// Creates (or truncates) `path` for writing.
  static LocalFile create(const std::filesystem::path& path);
  /// Opens `path` for reading.
  static LocalFile open_read(const std::filesystem::path& path);
  LocalFile(LocalFile&& other) noexcept;
  LocalFile& operator=(LocalFile&& other) = delete;
  LocalFile(const LocalFile&) = delete;
  LocalFile& operator=(const LocalFile&) = delete;
  ~LocalFile();

  /// The file's size in bytes.
  std::uint64_t size() const;
  /// Sets the file's size (ftruncate); throws td::Error naming the file.
  void resize(std::uint64_t bytes);
  /// Writes every range; throws td::Error naming the file.
  void write(std::span<const FileRange> ranges);
  /// Fills every range; a range beyond the end of the file is a td::Error.
  void read(std::span<const FileRange> ranges);
  /// fsync.
  void sync();
  /// Closes, reporting a failed close.
  void close();

 private:
  LocalFile(int fd, std::filesystem::path path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::filesystem::path path_;
};

/// A file opened collectively by every rank of a group (MPI-IO, MPI_File_open on the group's
/// communicator). Each rank passes its own ranges (disjoint from the other ranks' for writes);
/// every call is collective. Blocking calls run under the call's deadline (BlockingPhase).
///
/// Open MPI's MPI_File_open (ompio) hangs every rank when the open fails on a rank other than 0
/// (rank 0's failure is returned everywhere). So a group opens in agreed steps: rank 0 creates
/// the file (create_sized), every rank checks that it can open it (check_openable), the outcome
/// is agreed (agree_outcome), and only then does every rank call open().
class CollectiveFile {
 public:
  /// Creates (or truncates) `path` and gives it `bytes` bytes, with POSIX calls (rank 0 before a
  /// collective write): a failure is rank 0's alone, with the system's reason, where
  /// MPI_File_set_size said only "MPI_ERR_OTHER" (and was one more collective call).
  static void create_sized(const std::filesystem::path& path, std::uint64_t bytes);
  /// Opens and closes `path` with POSIX calls as open() will: a td::Error naming the file and the
  /// system's reason, on this rank alone.
  static void check_openable(const std::filesystem::path& path, bool write);
  /// Opens the existing `path` on every rank of `g` (for writing when `write`); throws td::Error.
  /// Call only once every rank passed check_openable.
  static CollectiveFile open(GroupState& g, const std::filesystem::path& path, bool write,
                             std::chrono::steady_clock::time_point deadline);
  CollectiveFile(CollectiveFile&& other) noexcept;
  CollectiveFile& operator=(CollectiveFile&& other) = delete;
  CollectiveFile(const CollectiveFile&) = delete;
  CollectiveFile& operator=(const CollectiveFile&) = delete;
  /// Closes a file still open (collective: reached by every rank on the same path).
  ~CollectiveFile();

  /// The file's size (MPI_File_get_size).
  std::uint64_t size() const;
  /// Collective writes of every rank's ranges (MPI_File_write_at_all through a file view), in
  /// rounds of at most a few hundred MiB per rank, so no count exceeds INT_MAX.
  void write(std::span<const FileRange> ranges);
  /// Collective reads (MPI_File_read_at_all), as write().
  void read(std::span<const FileRange> ranges);
  /// Collective reads where every rank also wants `shared`: the same file ranges (offsets and
  /// sizes, in the same order) on every rank, each into this rank's own memory. Each shared byte
  /// is read from the file once, by one rank (rank p an equal p-th share, with its `own` ranges in
  /// the same collective read), then broadcast to the others (MPI_Bcast of each share).
  void read_shared(std::span<const FileRange> shared, std::span<const FileRange> own);
  /// MPI_File_sync: the data is on storage when it returns on every rank.
  void sync();
  /// MPI_File_close (collective).
  void close();

 private:
  CollectiveFile(GroupState& g, MPI_File fh, std::filesystem::path path,
                 std::chrono::steady_clock::time_point deadline)
      : group_(&g), fh_(fh), path_(std::move(path)), deadline_(deadline) {}
  void transfer(std::span<const FileRange> ranges, bool write);
  GroupState* group_ = nullptr;
  MPI_File fh_ = MPI_FILE_NULL;
  std::filesystem::path path_;
  std::chrono::steady_clock::time_point deadline_;
};

/// An error caught on one rank, as text every rank can rethrow with the same type.
struct ErrorNote {
  char kind = 0;  // 0: none; 'E' td::Error, 'L' td::LayoutMismatchError, 'K' td::KeyError,
                  // 'T' td::TimeoutError, 'M' td::MpiError, 'I' std::invalid_argument
  std::string what;
  explicit operator bool() const { return kind != 0; }
};
/// The note of the exception being handled (call inside a catch block).
ErrorNote note_current_exception();
/// Throws the note's exception.
[[noreturn]] void rethrow_note(const ErrorNote& note);
/// Runs f, returning the note of what it threw (empty if nothing).
template <class F>
ErrorNote capture_error(F&& f) {
  try {
    f();
    return {};
  } catch (...) {
    return note_current_exception();
  }
}

/// Every rank's local outcome made one: the note of the lowest rank that failed (its message
/// prefixed with "rank r: "), the same on every rank, or an empty note.
/// One small nonblocking collective (more only after a failure), polled against `deadline`.
ErrorNote agree_outcome(GroupState& g, const ErrorNote& mine,
                        std::chrono::steady_clock::time_point deadline, std::string_view what);

/// The note of a rank whose `path` is not rank 0's (every rank of a group must name the same
/// file): rank 0's path is broadcast, each rank compares. Agree on the result with agree_outcome.
ErrorNote check_same_path(GroupState& g, const std::filesystem::path& path,
                          std::chrono::steady_clock::time_point deadline, std::string_view what);

/// `flags` made the bitwise AND of every rank's (same length on every rank), in place.
void and_over_ranks(GroupState& g, std::vector<std::uint8_t>& flags,
                    std::chrono::steady_clock::time_point deadline, std::string_view what);

/// Drops the page cache of the file `target` if it exists (posix_fadvise DONTNEED; its data
/// stays on storage). A save calls it before writing the new copy beside it: the new file's pages
/// then reuse the old one's instead of needing as much memory again (1 GiB saved in 1.6-2.1 s
/// instead of 6-12 s on a VM whose free memory is cold). Errors are ignored.
void drop_cached(const std::filesystem::path& target);

/// A name beside `target` for its temporary copy: ".<name>.td-tmp-<nonce>".
std::filesystem::path temp_path_beside(const std::filesystem::path& target, std::string_view nonce);
/// A fresh nonce for temp_path_beside (process id, time, a counter).
std::string temp_nonce();
/// Renames `tmp` over the file `target` and makes the rename durable (fsync of the directory).
void replace_file(const std::filesystem::path& tmp, const std::filesystem::path& target);
/// Puts the directory `tmp` in the place of `target` (atomically exchanged when `target` exists,
/// where the file system supports it), then removes the old tree; the rename is made durable.
void replace_directory(const std::filesystem::path& tmp, const std::filesystem::path& target);
/// fsync of a directory (after creating or renaming entries in it).
void sync_directory(const std::filesystem::path& dir);
/// Removes a file or tree, ignoring errors (cleanup after a failure).
void remove_quietly(const std::filesystem::path& path);
/// A small file's whole contents (meta.json); `limit` bytes at most, else td::Error.
std::string read_small_file(const std::filesystem::path& path, std::uint64_t limit);
/// Writes `bytes` to a new file at `path` and fsyncs it.
void write_small_file(const std::filesystem::path& path, std::string_view bytes);

}  // namespace td::detail
