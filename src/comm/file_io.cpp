// Checkpoint file I/O: POSIX for one process, collective MPI-IO for a group, the outcome
// agreement and the atomic-replace steps (see file_io.hpp).
#include "comm/file_io.hpp"

#include "comm/collective_engine.hpp"
#include "comm/executor.hpp"
#include "core/config.hpp"
#include "runtime/deadline.hpp"
#include "runtime/mpi_error.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <stdexcept>
#include <system_error>

#include <fmt/format.h>

namespace td::detail {

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

[[noreturn]] void throw_errno(std::string_view what, const fs::path& path, int err) {
  throw Error(fmt::format("{}: {} failed: {}", path.string(), what, std::strerror(err)));
}

// Ranges at most this large go through the staging buffer with their neighbours.
constexpr std::uint64_t kSmallRange = std::uint64_t{1} << 20;
constexpr std::uint64_t kStagingBytes = std::uint64_t{8} << 20;
// Bytes one rank moves per collective MPI-IO call (and the largest block of a datatype), unless
// a test sets fewer (TD_TEST_IO_ROUND_BYTES).
constexpr std::uint64_t kRoundBytes = std::uint64_t{512} << 20;
std::uint64_t round_bytes() {
  const std::uint64_t b = config().test_io_round_bytes;
  return b > 0 ? b : kRoundBytes;
}

void pwrite_all(int fd, const std::byte* p, std::uint64_t n, std::uint64_t off,
                const fs::path& path) {
  while (n > 0) {
    const auto chunk = static_cast<std::size_t>(std::min<std::uint64_t>(n, std::uint64_t{1} << 30));
    const ssize_t w = ::pwrite(fd, p, chunk, static_cast<off_t>(off));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw_errno("write", path, errno);
    }
    p += w;
    n -= static_cast<std::uint64_t>(w);
    off += static_cast<std::uint64_t>(w);
  }
}

void pread_all(int fd, std::byte* p, std::uint64_t n, std::uint64_t off, const fs::path& path) {
  while (n > 0) {
    const auto chunk = static_cast<std::size_t>(std::min<std::uint64_t>(n, std::uint64_t{1} << 30));
    const ssize_t r = ::pread(fd, p, chunk, static_cast<off_t>(off));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw_errno("read", path, errno);
    }
    if (r == 0)
      throw Error(fmt::format("{}: truncated: a read at byte {} found the end of the file",
                              path.string(), off));
    p += r;
    n -= static_cast<std::uint64_t>(r);
    off += static_cast<std::uint64_t>(r);
  }
}

std::vector<FileRange> sorted(std::span<const FileRange> ranges) {
  std::vector<FileRange> out;
  out.reserve(ranges.size());
  for (const auto& r : ranges)
    if (r.size > 0) out.push_back(r);
  std::sort(out.begin(), out.end(),
            [](const FileRange& a, const FileRange& b) { return a.offset < b.offset; });
  return out;
}

// Calls f(first, last) for each group of ranges [first, last) that go through one staging
// buffer (small, back to back in the file, together at most kStagingBytes), or alone.
template <class F>
void for_each_batch(const std::vector<FileRange>& rs, F&& f) {
  std::size_t i = 0;
  while (i < rs.size()) {
    std::size_t j = i + 1;
    if (rs[i].size <= kSmallRange) {
      std::uint64_t bytes = rs[i].size;
      while (j < rs.size() && rs[j].size <= kSmallRange &&
             rs[j].offset == rs[j - 1].offset + rs[j - 1].size &&
             bytes + rs[j].size <= kStagingBytes) {
        bytes += rs[j].size;
        ++j;
      }
    }
    f(i, j);
    i = j;
  }
}

}  // namespace

// ---- LocalFile -------------------------------------------------------------------------------

LocalFile LocalFile::create(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw_errno("create", path, errno);
  return {fd, path};
}

LocalFile LocalFile::open_read(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw_errno("open", path, errno);
  return {fd, path};
}

LocalFile::LocalFile(LocalFile&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)) {}

LocalFile::~LocalFile() {
  if (fd_ >= 0) ::close(fd_);
}

std::uint64_t LocalFile::size() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) throw_errno("stat", path_, errno);
  if (!S_ISREG(st.st_mode)) throw Error(fmt::format("{}: not a regular file", path_.string()));
  return static_cast<std::uint64_t>(st.st_size);
}

void LocalFile::resize(std::uint64_t bytes) {
  while (::ftruncate(fd_, static_cast<off_t>(bytes)) != 0)
    if (errno != EINTR) throw_errno("ftruncate", path_, errno);
}

void LocalFile::write(std::span<const FileRange> ranges) {
  const auto rs = sorted(ranges);
  std::vector<std::byte> staging;
  for_each_batch(rs, [&](std::size_t i, std::size_t j) {
    if (j == i + 1) return pwrite_all(fd_, rs[i].data, rs[i].size, rs[i].offset, path_);
    staging.resize(kStagingBytes);
    std::uint64_t used = 0;
    for (std::size_t k = i; k < j; ++k) {
      std::memcpy(staging.data() + used, rs[k].data, rs[k].size);
      used += rs[k].size;
    }
    pwrite_all(fd_, staging.data(), used, rs[i].offset, path_);
  });
}

void LocalFile::read(std::span<const FileRange> ranges) {
  const auto rs = sorted(ranges);
  std::vector<std::byte> staging;
  for_each_batch(rs, [&](std::size_t i, std::size_t j) {
    if (j == i + 1) return pread_all(fd_, rs[i].data, rs[i].size, rs[i].offset, path_);
    staging.resize(kStagingBytes);
    const std::uint64_t used = rs[j - 1].offset + rs[j - 1].size - rs[i].offset;
    pread_all(fd_, staging.data(), used, rs[i].offset, path_);
    for (std::size_t k = i; k < j; ++k)
      std::memcpy(rs[k].data, staging.data() + (rs[k].offset - rs[i].offset), rs[k].size);
  });
}

void LocalFile::sync() {
  if (::fsync(fd_) != 0) throw_errno("fsync", path_, errno);
}

void LocalFile::close() {
  const int fd = std::exchange(fd_, -1);
  if (fd >= 0 && ::close(fd) != 0) throw_errno("close", path_, errno);
}

// ---- CollectiveFile --------------------------------------------------------------------------

void CollectiveFile::create_sized(const fs::path& path, std::uint64_t bytes) {
  LocalFile f = LocalFile::create(path);
  f.resize(bytes);
  f.close();
}

void CollectiveFile::check_openable(const fs::path& path, bool write) {
  const int fd = ::open(path.c_str(), (write ? O_WRONLY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) throw_errno(write ? "open for writing" : "open", path, errno);
  ::close(fd);
}

CollectiveFile CollectiveFile::open(GroupState& g, const fs::path& path, bool write,
                                    Clock::time_point deadline) {
  MPI_File fh = MPI_FILE_NULL;
  const int mode = write ? MPI_MODE_WRONLY : MPI_MODE_RDONLY;
  const std::function<std::string()> describe = [&] {
    return fmt::format("MPI_File_open of {} on a group of {}", path.string(), g.size);
  };
  {
    BlockingPhase phase(deadline, describe);
    const int rc = MPI_File_open(g.comm, path.c_str(), mode, MPI_INFO_NULL, &fh);
    if (rc != MPI_SUCCESS) {
      char text[MPI_MAX_ERROR_STRING];
      int len = 0;
      if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
      throw Error(fmt::format("{}: MPI_File_open failed: {}", path.string(),
                              std::string(text, static_cast<std::size_t>(len))));
    }
  }
  TD_MPI_CHECK(MPI_File_set_errhandler(fh, MPI_ERRORS_RETURN));
  return {g, fh, path, deadline};
}

CollectiveFile::CollectiveFile(CollectiveFile&& other) noexcept
    : group_(other.group_),
      fh_(std::exchange(other.fh_, MPI_FILE_NULL)),
      path_(std::move(other.path_)),
      deadline_(other.deadline_) {}

CollectiveFile::~CollectiveFile() {
  if (fh_ != MPI_FILE_NULL) MPI_File_close(&fh_);
}

std::uint64_t CollectiveFile::size() const {
  MPI_Offset bytes = 0;
  TD_MPI_CHECK(MPI_File_get_size(fh_, &bytes));
  return static_cast<std::uint64_t>(bytes);
}

std::vector<std::vector<FileRange>> split_rounds(const std::vector<FileRange>& blocks,
                                                 std::uint64_t round_bytes) {
  std::vector<std::vector<FileRange>> rounds;
  std::uint64_t in_round = round_bytes;
  for (const auto& r : blocks) {
    std::uint64_t done = 0;
    while (done < r.size) {
      if (in_round == round_bytes) {
        rounds.emplace_back();
        in_round = 0;
      }
      const std::uint64_t n = std::min(r.size - done, round_bytes - in_round);
      auto& cur = rounds.back();
      if (!cur.empty() && cur.back().offset + cur.back().size == r.offset + done &&
          cur.back().data + cur.back().size == r.data + done) {
        cur.back().size += n;  // adjacent in the file and in memory: one block
      } else {
        cur.push_back({r.offset + done, r.data + done, n});
      }
      done += n;
      in_round += n;
    }
  }
  return rounds;
}

namespace {

// The two hindexed types of one round: its blocks in the file (from offset 0) and in memory
// (absolute addresses, for MPI_BOTTOM); freed with the object.
struct RoundTypes {
  MPI_Datatype file = MPI_DATATYPE_NULL, memory = MPI_DATATYPE_NULL;
  explicit RoundTypes(const std::vector<FileRange>& round) {
    const int n = mpi_count(round.size(), "blocks of a collective file transfer");
    std::vector<int> lens(round.size());
    std::vector<MPI_Aint> file_displs(round.size()), mem_displs(round.size());
    for (std::size_t i = 0; i < round.size(); ++i) {
      lens[i] = static_cast<int>(round[i].size);  // <= round_bytes() <= 512 MiB < INT_MAX
      file_displs[i] = static_cast<MPI_Aint>(round[i].offset);
      TD_MPI_CHECK(MPI_Get_address(round[i].data, &mem_displs[i]));
    }
    TD_MPI_CHECK(MPI_Type_create_hindexed(n, lens.data(), file_displs.data(), MPI_BYTE, &file));
    TD_MPI_CHECK(MPI_Type_commit(&file));
    TD_MPI_CHECK(MPI_Type_create_hindexed(n, lens.data(), mem_displs.data(), MPI_BYTE, &memory));
    TD_MPI_CHECK(MPI_Type_commit(&memory));
  }
  RoundTypes(const RoundTypes&) = delete;
  RoundTypes& operator=(const RoundTypes&) = delete;
  ~RoundTypes() {
    if (file != MPI_DATATYPE_NULL) MPI_Type_free(&file);
    if (memory != MPI_DATATYPE_NULL) MPI_Type_free(&memory);
  }
};

}  // namespace

void CollectiveFile::transfer(std::span<const FileRange> ranges, bool write) {
  // Split every range into blocks of at most round_bytes() and deal them into rounds of at most
  // that many bytes each; every rank runs as many collective calls as the rank with most rounds.
  const auto rs = sorted(ranges);
  // Small ranges back to back in the file go through staging buffers, one block per batch
  // instead of one per range: MPI-IO's cost grows with the blocks of a datatype (16384 leaves of
  // 4 KiB took 1.2 s to save at 2 ranks as 8192 blocks per rank).
  // (Not zeroed first: every byte of a buffer is copied in, or read from the file, before use.)
  struct Staged {
    std::unique_ptr<std::byte[]> buf;
    std::size_t first = 0, last = 0;
  };
  std::deque<Staged> staged;
  std::vector<FileRange> blocks;
  for_each_batch(rs, [&](std::size_t i, std::size_t j) {
    if (j == i + 1) {
      blocks.push_back(rs[i]);
      return;
    }
    const std::uint64_t bytes = rs[j - 1].offset + rs[j - 1].size - rs[i].offset;
    Staged& st =
        staged.emplace_back(Staged{std::make_unique_for_overwrite<std::byte[]>(bytes), i, j});
    if (write)
      for (std::size_t k = i; k < j; ++k)
        std::memcpy(st.buf.get() + (rs[k].offset - rs[i].offset), rs[k].data, rs[k].size);
    blocks.push_back({rs[i].offset, st.buf.get(), bytes});
  });
  const auto rounds = split_rounds(blocks, round_bytes());
  auto count = std::make_shared<std::uint64_t>(rounds.size());
  const std::function<std::string()> describe = [&] {
    return fmt::format("collective {} of {} on a group of {}", write ? "write" : "read",
                       path_.string(), group_->size);
  };
  Step step(deadline_, describe, count, "checkpoint file transfer");
  step.post(
      control(allreduce_call(MPI_IN_PLACE, count.get(), 1, MPI_UINT64_T, MPI_MAX, group_->comm)));
  step.wait();

  BlockingPhase phase(deadline_, describe);
  for (std::uint64_t k = 0; k < *count; ++k) {
    MPI_Status status;
    if (k >= rounds.size()) {  // nothing left here: take part with no data
      TD_MPI_CHECK(MPI_File_set_view(fh_, 0, MPI_BYTE, MPI_BYTE, "native", MPI_INFO_NULL));
      if (write) {
        TD_MPI_CHECK(MPI_File_write_at_all(fh_, 0, nullptr, 0, MPI_BYTE, &status));
      } else {
        TD_MPI_CHECK(MPI_File_read_at_all(fh_, 0, nullptr, 0, MPI_BYTE, &status));
      }
      continue;
    }
    const auto& round = rounds[k];
    const RoundTypes types(round);
    TD_MPI_CHECK(MPI_File_set_view(fh_, 0, MPI_BYTE, types.file, "native", MPI_INFO_NULL));
    if (write) {
      TD_MPI_CHECK(MPI_File_write_at_all(fh_, 0, MPI_BOTTOM, 1, types.memory, &status));
    } else {
      TD_MPI_CHECK(MPI_File_read_at_all(fh_, 0, MPI_BOTTOM, 1, types.memory, &status));
      int got = 0;
      TD_MPI_CHECK(MPI_Get_count(&status, MPI_BYTE, &got));
      std::uint64_t want = 0;
      for (const auto& r : round) want += r.size;
      if (got != MPI_UNDEFINED && static_cast<std::uint64_t>(got) != want)
        throw Error(fmt::format("{}: truncated: a collective read got {} of {} bytes",
                                path_.string(), got, want));
    }
  }
  if (!write)
    for (const Staged& st : staged)
      for (std::size_t k = st.first; k < st.last; ++k)
        std::memcpy(rs[k].data, st.buf.get() + (rs[k].offset - rs[st.first].offset), rs[k].size);
}

void CollectiveFile::read_shared(std::span<const FileRange> shared,
                                 std::span<const FileRange> own) {
  // Share p of the shared bytes (their concatenation in file order, cut into equal parts) is
  // read by rank p alone, in the same collective read as its own ranges; then each share is
  // broadcast from its reader into every other rank's memory. Every byte leaves the file once.
  const auto rs = sorted(shared);
  const auto n = static_cast<std::uint64_t>(group_->size);
  std::uint64_t total = 0;
  for (const auto& r : rs) total += r.size;
  auto cut = [&](std::uint64_t p) { return total / n * p + total % n * p / n; };
  std::vector<std::vector<FileRange>> shares(n);
  std::uint64_t pos = 0, p = 0;
  for (const auto& r : rs) {
    std::uint64_t done = 0;
    while (done < r.size) {
      while (pos >= cut(p + 1)) ++p;
      const std::uint64_t len = std::min(r.size - done, cut(p + 1) - pos);
      shares[p].push_back({r.offset + done, r.data + done, len});
      done += len;
      pos += len;
    }
  }
  std::vector<FileRange> mine(own.begin(), own.end());
  const auto& my_share = shares[static_cast<std::size_t>(group_->rank)];
  mine.insert(mine.end(), my_share.begin(), my_share.end());
  transfer(mine, false);
  const std::function<std::string()> describe = [&] {
    return fmt::format("broadcast of the tensors read from {} on a group of {}", path_.string(),
                       group_->size);
  };
  if (n == 1) return;
  BlockingPhase phase(deadline_, describe);
  for (std::uint64_t root = 0; root < n; ++root)
    for (const auto& round : split_rounds(shares[root], round_bytes())) {
      const RoundTypes types(round);
      post(bcast_call(MPI_BOTTOM, 1, types.memory, static_cast<int>(root), group_->comm), nullptr);
    }
}

void CollectiveFile::write(std::span<const FileRange> ranges) { transfer(ranges, true); }
void CollectiveFile::read(std::span<const FileRange> ranges) { transfer(ranges, false); }

void CollectiveFile::sync() {
  const std::function<std::string()> describe = [&] {
    return fmt::format("MPI_File_sync of {}", path_.string());
  };
  BlockingPhase phase(deadline_, describe);
  TD_MPI_CHECK(MPI_File_sync(fh_));
}

void CollectiveFile::close() {
  const std::function<std::string()> describe = [&] {
    return fmt::format("MPI_File_close of {}", path_.string());
  };
  BlockingPhase phase(deadline_, describe);
  TD_MPI_CHECK(MPI_File_close(&fh_));
}

// ---- outcome agreement -----------------------------------------------------------------------

ErrorNote note_current_exception() {
  try {
    throw;
  } catch (const LayoutMismatchError& e) {
    return {'L', e.what()};
  } catch (const KeyError& e) {
    return {'K', e.what()};
  } catch (const TimeoutError& e) {
    return {'T', e.what()};
  } catch (const MpiError& e) {
    return {'M', e.what()};
  } catch (const Error& e) {
    return {'E', e.what()};
  } catch (const std::invalid_argument& e) {
    return {'I', e.what()};
  } catch (const std::exception& e) {
    return {'E', e.what()};
  } catch (...) {
    return {'E', "unknown exception"};
  }
}

void rethrow_note(const ErrorNote& note) {
  switch (note.kind) {
    case 'L':
      throw LayoutMismatchError(note.what);
    case 'K':
      throw KeyError(note.what);
    case 'T':
      throw TimeoutError(note.what);
    case 'M':
      throw MpiError(note.what);
    case 'I':
      throw std::invalid_argument(note.what);
    default:
      throw Error(note.what);
  }
}

ErrorNote agree_outcome(GroupState& g, const ErrorNote& mine, Clock::time_point deadline,
                        std::string_view what) {
  if (g.size == 1) {
    if (!mine || mine.kind == 'L') return mine;
    return {mine.kind, fmt::format("rank 0: {}", mine.what)};
  }
  // The lowest failed rank, in one MIN (size: no rank failed), then that rank's note to every
  // rank: its length, then its text. Steps of the executor, polled against the deadline.
  struct Hold {
    int lowest = 0;
    int len = 0;
    std::string text;
  };
  auto hold = std::make_shared<Hold>();
  hold->lowest = mine ? g.rank : g.size;
  const std::function<std::string()> describe = [&] {
    return fmt::format("{}: not every rank of the group of {} reached the same step", what, g.size);
  };
  Step step(deadline, describe, hold, what);
  step.post(control(allreduce_call(MPI_IN_PLACE, &hold->lowest, 1, MPI_INT, MPI_MIN, g.comm)));
  step.wait();
  if (hold->lowest == g.size) return {};
  if (g.rank == hold->lowest) hold->text = std::string(1, mine.kind) + mine.what;
  hold->len = static_cast<int>(hold->text.size());
  step.post(control(bcast_call(&hold->len, 1, MPI_INT, hold->lowest, g.comm)));
  step.wait();
  hold->text.resize(static_cast<std::size_t>(hold->len));
  step.post(control(bcast_call(hold->text.data(), hold->len, MPI_CHAR, hold->lowest, g.comm)));
  step.wait();
  const std::string& text = hold->text;
  if (text.empty()) return {'E', fmt::format("{}: rank {} failed", what, hold->lowest)};
  const std::string_view msg = std::string_view(text).substr(1);
  // Errors that name a disagreement are already the same text on every rank.
  return {text[0],
          text[0] == 'L' ? std::string(msg) : fmt::format("rank {}: {}", hold->lowest, msg)};
}

ErrorNote check_same_path(GroupState& g, const fs::path& path, Clock::time_point deadline,
                          std::string_view what) {
  if (g.size == 1) return {};
  struct Hold {
    int len = 0;
    std::string text;
  };
  auto hold = std::make_shared<Hold>();
  if (g.rank == 0) hold->text = path.string();
  hold->len = static_cast<int>(hold->text.size());
  const std::function<std::string()> describe = [&] {
    return fmt::format("{}: not every rank of the group of {} reached the same step", what, g.size);
  };
  Step step(deadline, describe, hold, what);
  step.post(control(bcast_call(&hold->len, 1, MPI_INT, 0, g.comm)));
  step.wait();
  hold->text.resize(static_cast<std::size_t>(hold->len));
  step.post(control(bcast_call(hold->text.data(), hold->len, MPI_CHAR, 0, g.comm)));
  step.wait();
  if (hold->text == path.string()) return {};
  return {'E', fmt::format("{}: this rank names the file '{}' but rank 0 names '{}': every rank "
                           "of the group must pass the same path",
                           what, path.string(), hold->text)};
}

void and_over_ranks(GroupState& g, std::vector<std::uint8_t>& flags, Clock::time_point deadline,
                    std::string_view what) {
  if (g.size == 1 || flags.empty()) return;
  auto hold = std::make_shared<std::vector<std::uint8_t>>(std::move(flags));
  const std::function<std::string()> describe = [&] {
    return fmt::format("{}: not every rank of the group of {} reached the same step", what, g.size);
  };
  Step step(deadline, describe, hold, what);
  step.post(control(allreduce_call(MPI_IN_PLACE, hold->data(), mpi_count(hold->size(), "flags"),
                                   MPI_UINT8_T, MPI_BAND, g.comm)));
  step.wait();
  flags = *hold;
}

void drop_cached(const fs::path& target) {
  const int fd = ::open(target.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

// ---- atomic replace ----------------------------------------------------------------------------

fs::path temp_path_beside(const fs::path& target, std::string_view nonce) {
  const fs::path abs = target.has_parent_path() ? target : fs::path(".") / target;
  return abs.parent_path() / fmt::format(".{}.td-tmp-{}", abs.filename().string(), nonce);
}

std::string temp_nonce() {
  static std::atomic<unsigned> counter{0};
  const auto t = std::chrono::system_clock::now().time_since_epoch().count();
  return fmt::format("{}-{:x}-{}", ::getpid(), static_cast<std::uint64_t>(t) & 0xffffffffu,
                     counter.fetch_add(1));
}

void sync_directory(const fs::path& dir) {
  const fs::path d = dir.empty() ? fs::path(".") : dir;
  const int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw_errno("open directory", d, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0 && err != EINVAL) throw_errno("fsync directory", d, err);
}

void replace_file(const fs::path& tmp, const fs::path& target) {
  if (::rename(tmp.c_str(), target.c_str()) != 0)
    throw_errno("rename over the target", target, errno);
  sync_directory(tmp.parent_path());
}

void replace_directory(const fs::path& tmp, const fs::path& target) {
  std::error_code ec;
  if (fs::exists(fs::symlink_status(target, ec))) {
    if (!fs::is_directory(fs::symlink_status(target, ec)))
      throw Error(fmt::format("{}: exists and is not a directory", target.string()));
    // Linux: swap the two names in one step, then remove the old tree under the temporary name.
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
      sync_directory(tmp.parent_path());
      fs::remove_all(tmp, ec);
      return;
    }
    if (errno != EINVAL && errno != ENOSYS) throw_errno("exchange with the target", target, errno);
    // No exchange on this file system: move the old tree aside first.
    const fs::path old = temp_path_beside(target, temp_nonce() + "-old");
    if (::rename(target.c_str(), old.c_str()) != 0) throw_errno("move aside", target, errno);
    if (::rename(tmp.c_str(), target.c_str()) != 0) {
      const int err = errno;
      (void)::rename(old.c_str(), target.c_str());
      throw_errno("rename over the target", target, err);
    }
    sync_directory(tmp.parent_path());
    fs::remove_all(old, ec);
    return;
  }
  if (::rename(tmp.c_str(), target.c_str()) != 0)
    throw_errno("rename to the target", target, errno);
  sync_directory(tmp.parent_path());
}

void remove_quietly(const fs::path& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
}

std::string read_small_file(const fs::path& path, std::uint64_t limit) {
  LocalFile f = LocalFile::open_read(path);
  const std::uint64_t n = f.size();
  if (n > limit)
    throw Error(
        fmt::format("{}: {} bytes, more than the {} this file may have", path.string(), n, limit));
  std::string out(static_cast<std::size_t>(n), '\0');
  const FileRange r{0, reinterpret_cast<std::byte*>(out.data()), n};
  f.read({&r, 1});
  return out;
}

void write_small_file(const fs::path& path, std::string_view bytes) {
  LocalFile f = LocalFile::create(path);
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): write() only reads the range
  const FileRange r{0, reinterpret_cast<std::byte*>(const_cast<char*>(bytes.data())), bytes.size()};
  f.write({&r, 1});
  f.sync();
  f.close();
}

}  // namespace td::detail
