// GuardedCpu: the CPU backend with memory the host cannot touch outside backend calls.
//
// The rule the CUDA backend needs (backend/backend.hpp): host code never reads or
// writes memory a backend allocated; values cross only through B::copy_to_host and
// B::copy_from_host. Without a GPU, breaking that rule goes unnoticed on the CPU
// backend, whose memory is the host's. GuardedCpu makes it fault instead:
//
// - Its tensors (empty, zeros) come from one arena of reserved pages, tagged
//   Device::cuda, kept PROT_NONE.
// - Every backend call (for_each, gemm, attention, the host transfers, zeros) opens
//   the arena for reading and writing, runs the CPU backend's code, and closes it.
// - Host code that dereferences a backend pointer between calls gets SIGSEGV; the
//   handler names the address and prints a backtrace, so the offending line shows.
//
// One mprotect of the whole arena per call keeps this cheap enough to run a training
// step of a small model. Calls are serialised by one mutex (ranks on threads take
// turns); a host access made by one thread while another is inside a call goes
// unnoticed, so the checks run one rank or rank threads that do not overlap.
#pragma once

#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <type_traits>
#include <typeinfo>
#include <mutex>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/comm/memory_access.hpp"
#include "tessera/core/buffer.hpp"
#include "tessera/core/error.hpp"

namespace tessera::testing {

class GuardedArena {
 public:
  static constexpr std::size_t kBytes = std::size_t{1} << 30;  // reserved, not committed
  static constexpr std::size_t kAlign = 256;

  static GuardedArena& instance() {
    static GuardedArena arena;
    return arena;
  }

  void* allocate(std::size_t bytes) {
    std::lock_guard lock(mu_);
    bytes = round(bytes);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < bytes) continue;
      const std::size_t at = it->first, left = it->second - bytes;
      free_.erase(it);
      if (left > 0) free_[at + bytes] = left;
      used_[at] = bytes;
      const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
      high_water_.store(std::max(high_water_.load(), (at + bytes + page - 1) / page * page));
      return base_ + at;
    }
    fail("GuardedCpu: the guarded arena of ", kBytes, " bytes is full allocating ", bytes, " bytes");
  }

  void release(void* p) {
    std::lock_guard lock(mu_);
    const auto at = static_cast<std::size_t>(static_cast<char*>(p) - base_);
    auto it = used_.find(at);
    if (it == used_.end()) return;
    std::size_t begin = at, len = it->second;
    used_.erase(it);
    auto next = free_.lower_bound(begin);
    if (next != free_.end() && next->first == begin + len) {
      len += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == begin) {
        begin = prev->first;
        len += prev->second;
        free_.erase(prev);
      }
    }
    free_[begin] = len;
  }

  bool contains(const void* p) const {
    auto c = static_cast<const char*>(p);
    return c >= base_ && c < base_ + kBytes;
  }

  /// Opens the arena for the duration of one backend call (calls nest).
  class Open {
   public:
    Open() : lock_(instance().call_mu_) {
      if (instance().depth_++ == 0) instance().protect(PROT_READ | PROT_WRITE);
    }
    ~Open() {
      if (--instance().depth_ == 0) instance().protect(PROT_NONE);
    }
    Open(const Open&) = delete;
    Open& operator=(const Open&) = delete;

   private:
    std::unique_lock<std::recursive_mutex> lock_;
  };

 private:
  GuardedArena() {
    void* p = mmap(nullptr, kBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) fail("GuardedCpu: cannot reserve ", kBytes, " bytes: ", std::strerror(errno));
    base_ = static_cast<char*>(p);
    free_[0] = kBytes;
    install_handler();
  }

  /// Only the pages ever handed out change protection: the rest stay PROT_NONE.
  void protect(int prot) {
    if (mprotect(base_, std::max<std::size_t>(high_water_.load(), 4096), prot) != 0) fail("GuardedCpu: mprotect: ", std::strerror(errno));
  }

  static std::size_t round(std::size_t b) { return (std::max<std::size_t>(b, 1) + kAlign - 1) / kAlign * kAlign; }

  static void on_segv(int sig, siginfo_t* info, void*) {
    if (instance().contains(info->si_addr)) {
      char line[160];
      const int n = std::snprintf(line, sizeof line,
                                  "GuardedCpu: host code touched backend memory at %p outside a backend call\n",
                                  info->si_addr);
      if (n > 0) (void)!write(STDERR_FILENO, line, static_cast<std::size_t>(n));
      void* frames[64];
      backtrace_symbols_fd(frames, backtrace(frames, 64), STDERR_FILENO);
    }
    signal(sig, SIG_DFL);
    raise(sig);
  }

  static void install_handler() {
    struct sigaction sa {};
    sa.sa_sigaction = &on_segv;
    sa.sa_flags = SA_SIGINFO | SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, nullptr);
  }

  char* base_ = nullptr;
  std::mutex mu_;
  std::map<std::size_t, std::size_t> free_, used_;  // offset -> bytes
  std::recursive_mutex call_mu_;
  int depth_ = 0;
  std::atomic<std::size_t> high_water_{0};
};

namespace detail {
// Which members of a functor are pointers, without naming them: an aggregate's
// fields are counted by how many initialisers it accepts, then bound by a
// structured binding. ops/ functors are such aggregates (pointers and scalars).
struct AnyField {
  template <class U>
  operator U() const;
};

template <class F, class... A>
consteval std::size_t field_count() {
  if constexpr (sizeof...(A) < 24 && requires { F{A{}..., AnyField{}}; })
    return field_count<F, A..., AnyField>();
  else
    return sizeof...(A);
}

template <class V>
void pointer_field(const V& v, std::size_t index, const char* functor) {
  if constexpr (std::is_pointer_v<V>) {
    TESSERA_CHECK(v == nullptr || GuardedArena::instance().contains(v), "GuardedCpu::for_each(", functor,
                  "): field ", index, " points to host memory, not the backend's");
  }
}

#define TESSERA_GUARDED_FIELDS(N, ...)                                  \
  if constexpr (n == N) {                                               \
    const auto& [__VA_ARGS__] = f;                                      \
    std::size_t i = 0;                                                  \
    auto check = [&](const auto&... m) { (pointer_field(m, i++, name), ...); }; \
    check(__VA_ARGS__);                                                 \
  }

/// Fails when a field of the functor is a pointer outside the backend's memory.
template <class F>
void check_functor_pointers(const F& f) {
  if constexpr (std::is_aggregate_v<F>) {
    constexpr std::size_t n = field_count<F>();
    const char* name = typeid(F).name();
    TESSERA_GUARDED_FIELDS(1, a)
    TESSERA_GUARDED_FIELDS(2, a, b)
    TESSERA_GUARDED_FIELDS(3, a, b, c)
    TESSERA_GUARDED_FIELDS(4, a, b, c, d)
    TESSERA_GUARDED_FIELDS(5, a, b, c, d, e)
    TESSERA_GUARDED_FIELDS(6, a, b, c, d, e, g)
    TESSERA_GUARDED_FIELDS(7, a, b, c, d, e, g, h)
    TESSERA_GUARDED_FIELDS(8, a, b, c, d, e, g, h, j)
    TESSERA_GUARDED_FIELDS(9, a, b, c, d, e, g, h, j, k)
    TESSERA_GUARDED_FIELDS(10, a, b, c, d, e, g, h, j, k, l)
    TESSERA_GUARDED_FIELDS(11, a, b, c, d, e, g, h, j, k, l, m)
    TESSERA_GUARDED_FIELDS(12, a, b, c, d, e, g, h, j, k, l, m, o)
    TESSERA_GUARDED_FIELDS(13, a, b, c, d, e, g, h, j, k, l, m, o, p)
    TESSERA_GUARDED_FIELDS(14, a, b, c, d, e, g, h, j, k, l, m, o, p, q)
    TESSERA_GUARDED_FIELDS(15, a, b, c, d, e, g, h, j, k, l, m, o, p, q, r)
    TESSERA_GUARDED_FIELDS(16, a, b, c, d, e, g, h, j, k, l, m, o, p, q, r, s)
    static_assert(n >= 1 && n <= 16, "GuardedCpu: a functor with more than 16 fields");
  }
}
#undef TESSERA_GUARDED_FIELDS
}  // namespace detail

struct GuardedCpu {
  static constexpr Device device = Device::cuda;  // not the host's memory, as far as callers know
  using Host = cpu::HostSide;  // host memory beside it (backend/host.hpp), unguarded

  template <class T>
  static Tensor<T> empty(Shape shape) {
    const auto n = static_cast<std::size_t>(shape.numel());
    if (n == 0) return Tensor<T>(shape, Buffer<T>());
    auto* p = static_cast<T*>(GuardedArena::instance().allocate(n * sizeof(T)));
    return Tensor<T>(shape, Buffer<T>(p, n, Device::cuda, &release));
  }
  template <class T>
  static Tensor<T> zeros(Shape shape) {
    Tensor<T> t = empty<T>(shape);
    GuardedArena::Open open;
    if (t.numel() > 0) std::memset(static_cast<void*>(t.data()), 0, t.bytes());
    return t;
  }

  template <class F>
  static void for_each(std::int64_t n, const F& f) {
    detail::check_functor_pointers(f);
    GuardedArena::Open open;
    Cpu::for_each(n, f);
  }

  template <class T, class C>
  static void gemm(Trans ta, Trans tb, accum_t<T> alpha, TensorView<const T> a, TensorView<const T> b,
                   accum_t<T> beta, TensorView<C> c) {
    resident("gemm", "A", a.data(), a.numel());
    resident("gemm", "B", b.data(), b.numel());
    resident("gemm", "C", c.data(), c.numel());
    GuardedArena::Open open;
    Cpu::gemm(ta, tb, alpha, a, b, beta, c);
  }
  template <class T, class C>
  static void gemm(Trans ta, Trans tb, accum_t<T> alpha, TensorView<const T> a, TensorView<const T> b,
                   accum_t<T> beta, TensorView<const C> c, TensorView<C> d) {
    resident("gemm", "A", a.data(), a.numel());
    resident("gemm", "B", b.data(), b.numel());
    resident("gemm", "C", c.data(), c.numel());
    resident("gemm", "D", d.data(), d.numel());
    GuardedArena::Open open;
    Cpu::gemm(ta, tb, alpha, a, b, beta, c, d);
  }

  static constexpr bool attention_takes_past_keys = Cpu::attention_takes_past_keys;
  template <class T>
  static void attention_forward(const AttentionShape& s, TensorView<const T> q, TensorView<const T> k,
                                TensorView<const T> v, TensorView<T> o, accum_t<T>* lse) {
    resident("attention_forward", "q", q.data(), q.numel());
    resident("attention_forward", "k", k.data(), k.numel());
    resident("attention_forward", "v", v.data(), v.numel());
    resident("attention_forward", "lse", lse, o.numel());
    GuardedArena::Open open;
    Cpu::attention_forward(s, q, k, v, o, lse);
  }

  template <class T>
  static void attention_backward(const AttentionShape& s, TensorView<const T> q, TensorView<const T> k,
                                 TensorView<const T> v, TensorView<const T> o, const accum_t<T>* lse,
                                 TensorView<const T> d_o, TensorView<T> dq, TensorView<T> dk, TensorView<T> dv) {
    GuardedArena::Open open;
    Cpu::attention_backward(s, q, k, v, o, lse, d_o, dq, dk, dv);
  }

  template <class T>
  static void copy_to_host(const T* src, T* dst, std::int64_t n) {
    GuardedArena::Open open;
    Cpu::copy_to_host(src, dst, n);
  }
  template <class T>
  static void copy_from_host(const T* src, T* dst, std::int64_t n) {
    GuardedArena::Open open;
    Cpu::copy_from_host(src, dst, n);
  }

  static void synchronize() { Cpu::synchronize(); }

  /// How thread ranks and the single rank move this backend's buffers. where() tells
  /// the arena from host memory (the NCCL-rules check); the arena is one device for
  /// every rank, so it does not tell ranks apart.
  static comm::MemoryAccess memory_access() {
    comm::MemoryAccess m;
    m.copy = [](void* dst, const void* src, std::size_t bytes) {
      GuardedArena::Open open;
      comm::detail::host_copy(dst, src, bytes);
    };
    m.reduce = [](void* dst, const void* src, std::size_t n, comm::DataType t, comm::ReduceOp op) {
      GuardedArena::Open open;
      comm::reduce_into(dst, src, n, t, op);
    };
    m.allocate = [](std::size_t bytes) { return GuardedArena::instance().allocate(bytes); };
    m.release = [](void* p) { GuardedArena::instance().release(p); };
    m.where = [](const void* p, std::size_t bytes) {
      const bool inside = GuardedArena::instance().contains(p) &&
                          (bytes == 0 || GuardedArena::instance().contains(static_cast<const char*>(p) + bytes - 1));
      return inside ? comm::Residence::this_device : comm::Residence::host;
    };
    return m;
  }

 private:
  static void release(void* p) { GuardedArena::instance().release(p); }

  /// Operands of the backend's own calls live in its memory: a host tensor here is a
  /// parameter or activation the model forgot to place on the backend.
  static void resident(const char* op, const char* operand, const void* p, std::int64_t n) {
    TESSERA_CHECK(n == 0 || GuardedArena::instance().contains(p), "GuardedCpu::", op, ": operand ", operand,
                  " is host memory, not the backend's");
  }
};

static_assert(Backend<GuardedCpu>, "GuardedCpu must satisfy the Backend concept");

}  // namespace tessera::testing
