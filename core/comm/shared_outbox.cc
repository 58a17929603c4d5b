#include "core/comm/shared_outbox.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "core/base/status_macros.h"

namespace shardserve::core {

void FutexWait(uint32_t* word, uint32_t expected) {
  if (::syscall(SYS_futex, word, FUTEX_WAIT, expected, nullptr, nullptr, 0) != 0 &&
      errno != EAGAIN && errno != EINTR) {
    throw std::runtime_error(absl::StrCat("futex wait failed: errno ", errno));
  }
}

void Ring(uint32_t* bell, const uint32_t* waiting, uint32_t round) {
  uint32_t seen = __atomic_load_n(bell, __ATOMIC_SEQ_CST);
  while (static_cast<int32_t>(round - seen) > 0 &&
         !__atomic_compare_exchange_n(bell, &seen, round, false, __ATOMIC_SEQ_CST,
                                      __ATOMIC_SEQ_CST)) {
  }
  if (__atomic_load_n(waiting, __ATOMIC_SEQ_CST) != 0) {
    ::syscall(SYS_futex, bell, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
  }
}

absl::StatusOr<std::unique_ptr<SharedOutbox>> SharedOutbox::Connect(RendezvousStore& store,
                                                                   const std::string& prefix,
                                                                   int rank, int world_size,
                                                                   int64_t block_bytes,
                                                                   absl::Duration timeout) {
  auto shm = std::make_unique<SharedOutbox>(rank, world_size);
  const uint64_t nonce = std::random_device{}() ^ (uint64_t{std::random_device{}()} << 32) ^
                         static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
  std::string mine = "none";
  if (block_bytes > 0 && world_size > 1) {
    shm->block_bytes = block_bytes;
    shm->outbox_size = SharedOutbox::OutboxBytes(world_size, block_bytes);
    shm->fd = ::memfd_create("shardserve-exchange", MFD_CLOEXEC);
    if (shm->fd >= 0 && ::ftruncate(shm->fd, static_cast<off_t>(shm->outbox_size)) == 0) {
      void* base =
          ::mmap(nullptr, shm->outbox_size, PROT_READ | PROT_WRITE, MAP_SHARED, shm->fd, 0);
      if (base != MAP_FAILED) {
        shm->outbox = static_cast<char*>(base);
        std::memcpy(shm->outbox, &nonce, sizeof(nonce));
        mine = absl::StrCat(::getpid(), " ", shm->fd, " ", nonce, " ", block_bytes);
      }
    }
  }
  const std::string key = prefix + "/shm/";
  SHARDSERVE_RETURN_IF_ERROR(store.Set(absl::StrCat(key, rank), mine));
  std::string mapped(world_size, '0');
  for (int q = 0; q < world_size; ++q) {
    if (q == rank) continue;
    SHARDSERVE_ASSIGN_OR_RETURN(const std::string theirs, store.Get(absl::StrCat(key, q), timeout));
    std::vector<std::string> f = absl::StrSplit(theirs, ' ');
    int64_t pid = 0, fd = 0, peer_block = 0;
    uint64_t peer_nonce = 0;
    if (f.size() != 4 || !absl::SimpleAtoi(f[0], &pid) || !absl::SimpleAtoi(f[1], &fd) ||
        !absl::SimpleAtoi(f[2], &peer_nonce) || !absl::SimpleAtoi(f[3], &peer_block) ||
        peer_block <= 0) {
      continue;
    }
    const std::string path = absl::StrCat("/proc/", pid, "/fd/", fd);
    int peer_fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    const bool writable = peer_fd >= 0;
    if (!writable) peer_fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (peer_fd < 0) continue;
    struct stat st;
    const size_t size = SharedOutbox::OutboxBytes(world_size, peer_block);
    void* base = MAP_FAILED;
    void* header = MAP_FAILED;
    if (::fstat(peer_fd, &st) == 0 && static_cast<size_t>(st.st_size) == size) {
      base = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, peer_fd, 0);
      if (writable) {
        header = ::mmap(nullptr, SharedOutbox::kHeader, PROT_READ | PROT_WRITE, MAP_SHARED,
                        peer_fd, 0);
      }
    }
    ::close(peer_fd);
    uint64_t seen = 0;
    if (base != MAP_FAILED) std::memcpy(&seen, base, sizeof(seen));
    if (base == MAP_FAILED || seen != peer_nonce) {  // another nonce: not our peer's memory
      if (base != MAP_FAILED) ::munmap(base, size);
      if (header != MAP_FAILED) ::munmap(header, SharedOutbox::kHeader);
      continue;
    }
    shm->peer_outbox[q] = static_cast<const char*>(base);
    shm->peer_size[q] = size;
    shm->peer_block_bytes[q] = peer_block;
    if (header != MAP_FAILED) shm->peer_header[q] = static_cast<char*>(header);
    // Waiting for its mail also takes a pidfd, to see it exit.
    const int pidfd =
        header != MAP_FAILED ? static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)) : -1;
    shm->peer_pidfd[q] = pidfd;
    mapped[q] = pidfd >= 0 ? '3' : header != MAP_FAILED ? '2' : '1';  // 2: can ring it; 3: mail
  }
  // Which peers map this rank's outbox (and can ring it, and watch it exit). Once every peer has
  // said, nobody opens it again. Every rank reads every rank's answer, so all agree on whether the
  // group parks on doorbells, and on whether it has mail.
  const std::string ok_key = prefix + "/shm-mapped/";
  SHARDSERVE_RETURN_IF_ERROR(store.Set(absl::StrCat(ok_key, rank), mapped));
  bool any = false;
  bool doorbells = true;
  bool mail = world_size <= SharedOutbox::kMaxMailWorld;
  for (int q = 0; q < world_size; ++q) {
    std::string theirs = mapped;
    if (q != rank) {
      SHARDSERVE_ASSIGN_OR_RETURN(theirs, store.Get(absl::StrCat(ok_key, q), timeout));
    }
    for (int p = 0; p < world_size; ++p) {
      if (p == q) continue;
      const char state = theirs.size() == static_cast<size_t>(world_size) ? theirs[p] : '0';
      doorbells = doorbells && state >= '2';
      mail = mail && state == '3';
    }
    if (q == rank) continue;
    shm->peer_reads_mine[q] = shm->outbox != nullptr &&
                              theirs.size() == static_cast<size_t>(world_size) &&
                              theirs[rank] != '0';
    any = any || shm->peer_reads_mine[q] || shm->peer_outbox[q] != nullptr;
  }
  if (!any) {
    shm.reset();
    return shm;
  }
  shm->doorbells = doorbells;
  shm->mail = mail;
  for (int q = 0; q < world_size; ++q) {
    if (!doorbells && shm->peer_header[q] != nullptr) {  // nobody rings: no writable mappings
      ::munmap(shm->peer_header[q], SharedOutbox::kHeader);
      shm->peer_header[q] = nullptr;
    }
    if (!mail && shm->peer_pidfd[q] >= 0) {
      ::close(shm->peer_pidfd[q]);
      shm->peer_pidfd[q] = -1;
    }
  }
  return shm;
}

}  // namespace shardserve::core
