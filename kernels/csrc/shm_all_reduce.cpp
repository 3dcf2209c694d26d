// All-reduce (sum) between the tensor-parallel ranks of one machine through a shared-memory segment.
//
// Why: on the host the ranks are processes on one machine, and gloo's TCP all-reduce costs ~0.5 ms a call on these
// VMs (two loopback round trips with wake-ups), which a decode step pays twice per layer. vLLM's CPU backend
// solves the same problem with a shared-memory all-reduce; this is ours. The process group (gloo) still does
// everything else: rendezvous, broadcasts, gathers, and the all-reduce of ranks on other machines.
//
// Layout: a header with one cache line per rank (its published sequence number and pid), then two buffer sets
// (by sequence parity) of one slot per rank. A call with sequence s copies the rank's input into its slot of set
// s % 2, publishes s, waits until every rank has published s, and sums the slots in rank order, so every rank
// gets the same bits. A rank reuses set s % 2 at s + 2 only after every rank published s + 1, i.e. after every
// rank finished reading set s % 2: two sets are enough. Inputs larger than a slot go in slot-sized pieces.
// A waiting rank checks its peers' pids every ~50 ms and fails naming the one that is gone, or the one that has
// not arrived after the timeout, instead of spinning forever.
#include <torch/extension.h>

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#if defined(__x86_64__)
#include <immintrin.h>
#define DEEPINFER_PAUSE() _mm_pause()
#else
#define DEEPINFER_PAUSE() do {} while (0)
#endif

namespace {

constexpr int64_t kLine = 64;

struct RankLine {
  uint64_t seq;
  int64_t pid;
  char pad[kLine - 16];
};

struct Segment {
  std::string name;
  int64_t rank = 0, world = 0, slot_bytes = 0;
  double timeout_s = 60.0;
  size_t size = 0;
  char* base = nullptr;
  uint64_t seq = 0;

  RankLine* line(int64_t r) const { return reinterpret_cast<RankLine*>(base + r * kLine); }
  char* slot(int64_t set, int64_t r) const {
    return base + world * kLine + (set * world + r) * slot_bytes;
  }
  ~Segment() {
    if (base != nullptr) munmap(base, size);
  }
};

// Handles -> segments: the op's schema carries an int handle (a graph cannot hold a pointer).
std::mutex registry_mutex;
std::unordered_map<int64_t, std::unique_ptr<Segment>>& registry() {
  static std::unordered_map<int64_t, std::unique_ptr<Segment>> segments;
  return segments;
}

Segment& lookup(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry().find(handle);
  TORCH_CHECK(it != registry().end(), "shm all-reduce: unknown handle ", handle);
  return *it->second;
}

void wait_for_all(Segment& s, uint64_t target) {
  auto start = std::chrono::steady_clock::now();
  auto last_check = start;
  int64_t spins = 0;
  for (int64_t r = 0; r < s.world; ++r) {
    while (__atomic_load_n(&s.line(r)->seq, __ATOMIC_ACQUIRE) < target) {
      DEEPINFER_PAUSE();
      if (++spins % 4096 != 0) continue;
      sched_yield();  // ranks may share a core with other threads: let them run
      auto now = std::chrono::steady_clock::now();
      if (now - last_check < std::chrono::milliseconds(50)) continue;
      last_check = now;
      int64_t pid = s.line(r)->pid;
      TORCH_CHECK(pid <= 0 || kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH,
                  "shm all-reduce: tensor-parallel rank ", r, " (pid ", pid, ") is gone");
      double waited = std::chrono::duration<double>(now - start).count();
      TORCH_CHECK(waited < s.timeout_s, "shm all-reduce: tensor-parallel rank ", r, " did not arrive within ",
                  s.timeout_s, " s");
    }
  }
}

// Rank order, the same on every rank: every rank gets the same bits.
void sum_slots_float(const Segment& s, int64_t set, float* __restrict__ out, int64_t count) {
  const float* __restrict__ first = reinterpret_cast<const float*>(s.slot(set, 0));
  const float* __restrict__ second = reinterpret_cast<const float*>(s.slot(set, 1));
  for (int64_t i = 0; i < count; ++i) out[i] = first[i] + second[i];
  for (int64_t r = 2; r < s.world; ++r) {
    const float* __restrict__ next = reinterpret_cast<const float*>(s.slot(set, r));
    for (int64_t i = 0; i < count; ++i) out[i] += next[i];
  }
}

void sum_slots_bf16(const Segment& s, int64_t set, at::BFloat16* out, int64_t count) {
  constexpr int64_t kTile = 1024;
  float acc[kTile];
  for (int64_t start = 0; start < count; start += kTile) {
    const int64_t n = std::min(kTile, count - start);
    const at::BFloat16* first = reinterpret_cast<const at::BFloat16*>(s.slot(set, 0)) + start;
    for (int64_t i = 0; i < n; ++i) acc[i] = static_cast<float>(first[i]);
    for (int64_t r = 1; r < s.world; ++r) {
      const at::BFloat16* next = reinterpret_cast<const at::BFloat16*>(s.slot(set, r)) + start;
      for (int64_t i = 0; i < n; ++i) acc[i] += static_cast<float>(next[i]);
    }
    for (int64_t i = 0; i < n; ++i) out[start + i] = static_cast<at::BFloat16>(acc[i]);
  }
}

}  // namespace

// Creates (rank 0, create=true) or opens the segment; returns a handle for shm_all_reduce.
int64_t shm_all_reduce_attach(const std::string& name, int64_t rank, int64_t world, int64_t slot_bytes,
                              double timeout_s, bool create) {
  TORCH_CHECK(world >= 2 && rank >= 0 && rank < world, "shm all-reduce: bad rank ", rank, " of ", world);
  TORCH_CHECK(slot_bytes > 0 && slot_bytes % kLine == 0, "shm all-reduce: slot_bytes must be a multiple of 64");
  auto s = std::make_unique<Segment>();
  s->name = name;
  s->rank = rank;
  s->world = world;
  s->slot_bytes = slot_bytes;
  s->timeout_s = timeout_s;
  s->size = static_cast<size_t>(world * kLine + 2 * world * slot_bytes);
  int fd = shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, "shm all-reduce: shm_open(", name, ") failed: ", std::strerror(errno));
  if (create && ftruncate(fd, static_cast<off_t>(s->size)) != 0) {
    int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    TORCH_CHECK(false, "shm all-reduce: ftruncate failed: ", std::strerror(err));
  }
  void* base = mmap(nullptr, s->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  TORCH_CHECK(base != MAP_FAILED, "shm all-reduce: mmap failed: ", std::strerror(errno));
  s->base = static_cast<char*>(base);
  __atomic_store_n(&s->line(rank)->pid, static_cast<int64_t>(getpid()), __ATOMIC_RELEASE);
  std::lock_guard<std::mutex> lock(registry_mutex);
  int64_t handle = static_cast<int64_t>(registry().size()) + 1;
  while (registry().count(handle)) ++handle;
  registry()[handle] = std::move(s);
  return handle;
}

// Removes the name (every rank has mapped it): nothing is left in /dev/shm, whatever happens to the processes.
void shm_all_reduce_unlink(const std::string& name) { shm_unlink(name.c_str()); }

void shm_all_reduce_detach(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry().erase(handle);
}

torch::Tensor shm_all_reduce(const torch::Tensor& x, int64_t handle) {
  TORCH_CHECK(x.device().is_cpu(), "shm all-reduce: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "shm all-reduce: float32 or bfloat16 only, got ", x.scalar_type());
  Segment& s = lookup(handle);
  auto input = x.contiguous();
  auto out = torch::empty_like(input);
  const int64_t elem = input.element_size();
  const int64_t per_piece = s.slot_bytes / elem;
  const int64_t total = input.numel();
  const char* src = static_cast<const char*>(input.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t done = 0; done < total || (total == 0 && done == 0); done += per_piece) {
    int64_t count = std::min(per_piece, total - done);
    uint64_t seq = ++s.seq;
    int64_t set = static_cast<int64_t>(seq % 2);
    std::memcpy(s.slot(set, s.rank), src + done * elem, count * elem);
    __atomic_store_n(&s.line(s.rank)->seq, seq, __ATOMIC_RELEASE);
    wait_for_all(s, seq);
    if (input.scalar_type() == at::kFloat) {
      sum_slots_float(s, set, reinterpret_cast<float*>(dst + done * elem), count);
    } else {
      sum_slots_bf16(s, set, reinterpret_cast<at::BFloat16*>(dst + done * elem), count);
    }
    if (total == 0) break;
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("shm_all_reduce(Tensor x, int handle) -> Tensor");
  m.def("shm_all_reduce_attach(str name, int rank, int world, int slot_bytes, float timeout_s, bool create) -> int",
        &shm_all_reduce_attach);
  m.def("shm_all_reduce_unlink(str name) -> ()", &shm_all_reduce_unlink);
  m.def("shm_all_reduce_detach(int handle) -> ()", &shm_all_reduce_detach);
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("shm_all_reduce", &shm_all_reduce);
}
