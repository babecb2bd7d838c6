// TcpStore: the rendezvous of a torchrun-style launch (RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT), over POSIX TCP sockets. No MPI, no CUDA: the NCCL bootstrap
// (comm/nccl.hpp) shares its unique id through it, and anything else that must agree
// before a communicator exists can use it too. It carries small blobs, not tensors.
//
// Rank 0 listens on the master port (all interfaces, SO_REUSEADDR); every other rank
// connects to master_addr:master_port, retrying until the deadline because rank 0 may
// start last, and introduces itself. The constructor returns once every rank has
// joined. Each operation is a star through rank 0: the ranks send their part to rank
// 0, rank 0 answers each of them, so a whole operation costs two messages per rank.
//
// Wire format: every message is one frame, a 32-byte header (magic "TSTS", kind,
// sequence number, argument, payload length; little-endian) and the payload. The
// sequence number counts this store's operations, so ranks that call different
// operations, or the same ones in another order, fail naming both instead of
// exchanging the wrong bytes. A header with a wrong magic, an unknown kind or a payload
// over 1 GiB is refused.
//
// Failure: every socket call's result is checked, every socket is non-blocking and
// every wait is a poll bounded by the operation's deadline (its start plus the
// timeout). A rank that never comes, a wrong port, a peer that dies or one that writes
// garbage gives a tessera::Error naming this rank, rank 0's address:port and what was
// being waited for; never a hang. When rank 0 fails it sends its reason to the ranks
// connected to it before closing, so they fail with it rather than a bare EOF.
// Every hello carries the world size its rank was started for: a rank whose size is
// not rank 0's fails the store on every rank with one message naming that rank and
// both sizes (rank 0 keeps telling the ranks that still connect, until none has come
// for 3 s).
//
// Not thread-safe: one store per rank, each called from one thread at a time.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"

namespace tessera::comm {

namespace detail {

using StoreClock = std::chrono::steady_clock;

/// An owned socket descriptor.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Socket& operator=(Socket&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket() { reset(); }

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }

  /// Closes after reading what the peer already sent: closing with unread input makes
  /// the kernel reset the connection, which can discard the last frame sent to the peer.
  void reset() noexcept {
    if (fd_ < 0) return;
    ::shutdown(fd_, SHUT_WR);
    char sink[4096];
    for (int i = 0; i < 64 && ::recv(fd_, sink, sizeof sink, MSG_DONTWAIT) > 0; ++i) {
    }
    ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

inline std::string errno_text(int err) { return std::strerror(err); }

/// "host:port", with an IPv6 literal in brackets.
inline std::string endpoint(const std::string& host, int port) {
  if (host.find(':') != std::string::npos) return tessera::detail::concat("[", host, "]:", port);
  return tessera::detail::concat(host, ":", port);
}

/// The peer address of a connected socket, for messages about unknown connections.
inline std::string peer_name(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "an unknown address";
  char host[INET6_ADDRSTRLEN] = {};
  int port = 0;
  if (addr.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&addr);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    port = ntohs(a->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&addr);
    if (IN6_IS_ADDR_V4MAPPED(&a->sin6_addr))  // an IPv4 peer of the dual-stack listener
      ::inet_ntop(AF_INET, a->sin6_addr.s6_addr + 12, host, sizeof host);
    else
      ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    port = ntohs(a->sin6_port);
  } else {
    return "an unknown address";
  }
  return endpoint(host, port);
}

/// Milliseconds left until `deadline` for poll(): 0 once it has passed.
inline int poll_ms(StoreClock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - StoreClock::now()).count();
  if (left <= 0) return 0;
  return left > 1'000'000 ? 1'000'000 : static_cast<int>(left);
}

enum class FrameKind : std::uint32_t { hello = 1, welcome = 2, all_gather = 3, broadcast = 4, barrier = 5, error = 6 };

inline const char* name_of(FrameKind k) {
  switch (k) {
    case FrameKind::hello:
      return "hello";
    case FrameKind::welcome:
      return "welcome";
    case FrameKind::all_gather:
      return "all_gather";
    case FrameKind::broadcast:
      return "broadcast";
    case FrameKind::barrier:
      return "barrier";
    case FrameKind::error:
      return "error";
  }
  return "?";
}

inline constexpr std::uint32_t kStoreMagic = 0x53545354;  // "TSTS" read as little-endian bytes
inline constexpr std::size_t kFrameHeaderBytes = 32;
inline constexpr std::uint64_t kMaxFramePayload = std::uint64_t{1} << 30;

struct Frame {
  FrameKind kind{};
  std::uint64_t seq = 0;
  std::uint64_t arg = 0;
  std::vector<std::uint8_t> payload;
};

inline void put_u32(std::uint8_t* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}
inline void put_u64(std::uint8_t* p, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}
inline std::uint32_t get_u32(const std::uint8_t* p) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(p[i]) << (8 * i);
  return v;
}
inline std::uint64_t get_u64(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}

inline std::vector<std::uint8_t> frame_header(FrameKind kind, std::uint64_t seq, std::uint64_t arg,
                                              std::uint64_t payload_bytes) {
  std::vector<std::uint8_t> h(kFrameHeaderBytes);
  put_u32(h.data(), kStoreMagic);
  put_u32(h.data() + 4, static_cast<std::uint32_t>(kind));
  put_u64(h.data() + 8, seq);
  put_u64(h.data() + 16, arg);
  put_u64(h.data() + 24, payload_bytes);
  return h;
}

}  // namespace detail

class TcpStore {
 public:
  /// Joins the store of `world_size` ranks whose rank 0 listens on master_port, and
  /// returns once every rank has joined. `timeout` bounds this and each operation.
  TcpStore(std::string master_addr, int master_port, int rank, int world_size, std::chrono::milliseconds timeout)
      : addr_(std::move(master_addr)), port_(master_port), rank_(rank), world_(world_size), timeout_(timeout) {
    TESSERA_CHECK(world_ >= 1, "TcpStore: a world of ", world_, " ranks");
    TESSERA_CHECK(rank_ >= 0 && rank_ < world_, "TcpStore: rank ", rank_, " is outside [0, ", world_, ")");
    TESSERA_CHECK(timeout_.count() > 0, "TcpStore rank ", rank_, ": timeout of ", timeout_.count(),
                  " ms: it must be positive");
    if (world_ == 1) return;  // nothing to meet
    TESSERA_CHECK(port_ >= 1 && port_ <= 65535, "TcpStore rank ", rank_, ": master port ", port_,
                  " is outside 1..65535");
    TESSERA_CHECK(!addr_.empty(), "TcpStore rank ", rank_, ": no master address for a world of ", world_, " ranks");
    const auto deadline = detail::StoreClock::now() + timeout_;
    if (rank_ == 0)
      as_root([&] { accept_ranks(deadline); });
    else
      join(deadline);
  }

  TcpStore(TcpStore&&) noexcept = default;
  TcpStore& operator=(TcpStore&&) noexcept = default;
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;
  ~TcpStore() = default;

  int rank() const { return rank_; }
  int size() const { return world_; }

  /// Every rank contributes `mine`; returns all ranks' blobs in rank order (rank 0 relays).
  std::vector<std::vector<std::uint8_t>> all_gather(std::span<const std::uint8_t> mine) {
    const std::uint64_t seq = ++seq_;
    std::vector<std::vector<std::uint8_t>> all(static_cast<std::size_t>(world_));
    all[static_cast<std::size_t>(rank_)].assign(mine.begin(), mine.end());
    if (world_ == 1) return all;
    const auto deadline = detail::StoreClock::now() + timeout_;
    const auto op = detail::FrameKind::all_gather;
    if (rank_ == 0) {
      as_root([&] {
        for (int r = 1; r < world_; ++r) {
          auto f = receive(peer(r), deadline, r, describe("rank ", r, "'s ", op_name(op, seq), " contribution"));
          expect(f, op, seq, 0, r);
          all[static_cast<std::size_t>(r)] = std::move(f.payload);
        }
        std::vector<std::uint8_t> joined;
        for (const auto& blob : all) {
          const std::size_t at = joined.size();
          joined.resize(at + 8 + blob.size());
          detail::put_u64(joined.data() + at, blob.size());
          if (!blob.empty()) std::memcpy(joined.data() + at + 8, blob.data(), blob.size());
        }
        for (int r = 1; r < world_; ++r)
          transmit(peer(r), op, seq, 0, joined, deadline, r, describe("sending the ", op_name(op, seq), " result"));
      });
      return all;
    }
    transmit(server_, op, seq, 0, mine, deadline, 0,
             describe("sending this rank's ", op_name(op, seq), " contribution"));
    auto f = receive(server_, deadline, 0, describe("rank 0's ", op_name(op, seq), " result"));
    expect(f, op, seq, 0, 0);
    // The reply is world_ blobs, each a u64 length and its bytes.
    std::size_t at = 0;
    for (int r = 0; r < world_; ++r) {
      TESSERA_CHECK(f.payload.size() - at >= 8, where(), "malformed frame from rank 0: its ", op_name(op, seq),
                    " result ends after ", r, " of ", world_, " blobs");
      const std::uint64_t n = detail::get_u64(f.payload.data() + at);
      at += 8;
      TESSERA_CHECK(n <= f.payload.size() - at, where(), "malformed frame from rank 0: blob ", r, " of its ",
                    op_name(op, seq), " result claims ", n, " bytes, only ", f.payload.size() - at, " remain");
      all[static_cast<std::size_t>(r)].assign(f.payload.begin() + static_cast<std::ptrdiff_t>(at),
                                              f.payload.begin() + static_cast<std::ptrdiff_t>(at + n));
      at += n;
    }
    TESSERA_CHECK(at == f.payload.size(), where(), "malformed frame from rank 0: ", f.payload.size() - at,
                  " bytes after the ", world_, " blobs of its ", op_name(op, seq), " result");
    return all;
  }

  /// root's blob on every rank (the others' `blob` is not read). Every rank reports
  /// to rank 0 with the root it names, so ranks that disagree on the root fail.
  std::vector<std::uint8_t> broadcast(std::span<const std::uint8_t> blob, int root) {
    TESSERA_CHECK(root >= 0 && root < world_, "TcpStore rank ", rank_, ": broadcast root ", root, " is outside [0, ",
                  world_, ")");
    const std::uint64_t seq = ++seq_;
    if (world_ == 1) return {blob.begin(), blob.end()};
    const auto deadline = detail::StoreClock::now() + timeout_;
    const auto op = detail::FrameKind::broadcast;
    const auto r0 = static_cast<std::uint64_t>(root);
    if (rank_ == 0) {
      std::vector<std::uint8_t> data(blob.begin(), blob.end());
      as_root([&] {
        for (int r = 1; r < world_; ++r) {
          auto f = receive(peer(r), deadline, r,
                           r == root ? describe("root rank ", r, "'s ", op_name(op, seq), " blob")
                                     : describe("rank ", r, " to reach ", op_name(op, seq)));
          expect(f, op, seq, r0, r);
          if (r == root) data = std::move(f.payload);
        }
        for (int r = 1; r < world_; ++r)
          transmit(peer(r), op, seq, r0, data, deadline, r, describe("sending the ", op_name(op, seq), " blob"));
      });
      return data;
    }
    transmit(server_, op, seq, r0, rank_ == root ? blob : std::span<const std::uint8_t>{}, deadline, 0,
             describe("sending this rank's ", op_name(op, seq), rank_ == root ? " blob" : " arrival"));
    auto f = receive(server_, deadline, 0, describe("rank 0 to relay the ", op_name(op, seq), " blob of root ", root));
    expect(f, op, seq, r0, 0);
    return std::move(f.payload);
  }

  /// Returns once every rank has called it.
  void barrier() {
    const std::uint64_t seq = ++seq_;
    if (world_ == 1) return;
    const auto deadline = detail::StoreClock::now() + timeout_;
    const auto op = detail::FrameKind::barrier;
    if (rank_ == 0) {
      as_root([&] {
        for (int r = 1; r < world_; ++r) {
          auto f = receive(peer(r), deadline, r, describe("rank ", r, " to reach ", op_name(op, seq)));
          expect(f, op, seq, 0, r);
        }
        for (int r = 1; r < world_; ++r)
          transmit(peer(r), op, seq, 0, {}, deadline, r, describe("releasing ", op_name(op, seq)));
      });
      return;
    }
    transmit(server_, op, seq, 0, {}, deadline, 0, describe("announcing this rank at ", op_name(op, seq)));
    auto f =
        receive(server_, deadline, 0, describe("rank 0 to release ", op_name(op, seq), " (every rank to reach it)"));
    expect(f, op, seq, 0, 0);
  }

 private:
  using Clock = detail::StoreClock;
  using Kind = detail::FrameKind;

  template <class... Parts>
  static std::string describe(Parts&&... parts) {
    return tessera::detail::concat(std::forward<Parts>(parts)...);
  }
  static std::string op_name(Kind k, std::uint64_t seq) { return describe(detail::name_of(k), " #", seq); }

  /// The prefix of every message: this rank and where rank 0 is.
  std::string where() const {
    return describe("TcpStore rank ", rank_, rank_ == 0 ? " (at " : " (rank 0 at ", detail::endpoint(addr_, port_),
                    "): ");
  }
  double timeout_s() const { return std::chrono::duration<double>(timeout_).count(); }

  const detail::Socket& peer(int r) const { return peers_[static_cast<std::size_t>(r)]; }

  /// Runs a step of rank 0; if it fails, the connected ranks are told why first.
  template <class F>
  void as_root(F&& step) {
    try {
      step();
    } catch (const Error& e) {
      for (const auto& s : peers_) tell_failure(s.fd(), e.what());
      throw;
    }
  }

  /// Best effort: an error frame carrying rank 0's reason, sent without waiting.
  static void tell_failure(int fd, std::string_view reason) {
    if (fd < 0) return;
    auto bytes = detail::frame_header(Kind::error, 0, 0, reason.size());
    bytes.insert(bytes.end(), reason.begin(), reason.end());
    (void)::send(fd, bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  }

  /// The reason in an error frame rank 0 sent before closing, if it can be read now
  /// (after a send to rank 0 failed); "" if there is none.
  static std::string rank0_reason(int fd) {
    std::vector<std::uint8_t> in;
    std::uint8_t buf[4096];
    for (ssize_t k; in.size() < (std::size_t{1} << 20) && (k = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT)) > 0;)
      in.insert(in.end(), buf, buf + k);
    // Skip the frames before it (a reply rank 0 sent before it failed).
    for (std::size_t at = 0; in.size() - at >= detail::kFrameHeaderBytes;) {
      const std::uint8_t* h = in.data() + at;
      if (detail::get_u32(h) != detail::kStoreMagic) break;
      const std::uint64_t n = detail::get_u64(h + 24);
      if (n > in.size() - at - detail::kFrameHeaderBytes) break;
      const auto* p = h + detail::kFrameHeaderBytes;
      if (detail::get_u32(h + 4) == static_cast<std::uint32_t>(Kind::error)) return std::string(p, p + n);
      at += detail::kFrameHeaderBytes + n;
    }
    return {};
  }

  /// Blocks in poll until `fd` is ready for `events` or the deadline passes.
  static bool wait_ready(int fd, short events, Clock::time_point deadline) {
    for (;;) {
      pollfd p{fd, events, 0};
      const int n = ::poll(&p, 1, detail::poll_ms(deadline));
      if (n > 0) return true;
      if (n == 0) return false;
      if (errno != EINTR) fail("TcpStore: poll: ", detail::errno_text(errno));
    }
  }

  /// "rank r" or, for a connection not yet introduced, its address.
  std::string who(int r, int fd) const {
    if (r >= 0) return describe("rank ", r);
    return describe("the connection from ", detail::peer_name(fd));
  }

  void send_bytes(int fd, const std::uint8_t* data, std::size_t n, Clock::time_point deadline, int r,
                  const std::string& what) const {
    while (n > 0) {
      if (!wait_ready(fd, POLLOUT, deadline))
        fail(where(), "timed out after ", timeout_s(), " s ", what, " to ", who(r, fd),
             ": it is not reading (its socket buffer is full)");
      const ssize_t k = ::send(fd, data, n, MSG_NOSIGNAL);
      if (k < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
        const int err = errno;
        if (r == 0 && rank_ != 0) {
          const std::string reason = rank0_reason(fd);
          if (!reason.empty()) fail(where(), "rank 0 failed while this rank was ", what, ": ", reason);
        }
        fail(where(), what, " to ", who(r, fd), " failed: ", detail::errno_text(err),
             " (the peer closed its connection)");
      }
      data += k;
      n -= static_cast<std::size_t>(k);
    }
  }

  void transmit(const detail::Socket& s, Kind kind, std::uint64_t seq, std::uint64_t arg,
                std::span<const std::uint8_t> payload, Clock::time_point deadline, int r,
                const std::string& what) const {
    const auto header = detail::frame_header(kind, seq, arg, payload.size());
    send_bytes(s.fd(), header.data(), header.size(), deadline, r, what);
    send_bytes(s.fd(), payload.data(), payload.size(), deadline, r, what);
  }

  void recv_bytes(int fd, std::uint8_t* data, std::size_t n, Clock::time_point deadline, int r,
                  const std::string& what) const {
    while (n > 0) {
      if (!wait_ready(fd, POLLIN, deadline)) fail(where(), "timed out after ", timeout_s(), " s waiting for ", what);
      const ssize_t k = ::recv(fd, data, n, 0);
      if (k == 0) fail(where(), who(r, fd), " closed its connection while this rank was waiting for ", what);
      if (k < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
        fail(where(), "receiving from ", who(r, fd), " failed (", detail::errno_text(errno), ") while waiting for ",
             what);
      }
      data += k;
      n -= static_cast<std::size_t>(k);
    }
  }

  /// One frame from `s` (rank r, or -1 for a connection not yet introduced). A bad
  /// header is refused before any payload is read.
  detail::Frame receive(const detail::Socket& s, Clock::time_point deadline, int r, const std::string& what) const {
    std::uint8_t h[detail::kFrameHeaderBytes];
    recv_bytes(s.fd(), h, sizeof h, deadline, r, what);
    const std::uint32_t magic = detail::get_u32(h), kind = detail::get_u32(h + 4);
    const std::uint64_t length = detail::get_u64(h + 24);
    if (magic != detail::kStoreMagic)
      fail(where(), "malformed frame from ", who(r, s.fd()), " while waiting for ", what, ": its header starts with 0x",
           hex(h, 4), ", not a TcpStore frame");
    if (kind < static_cast<std::uint32_t>(Kind::hello) || kind > static_cast<std::uint32_t>(Kind::error))
      fail(where(), "malformed frame from ", who(r, s.fd()), " while waiting for ", what, ": unknown frame kind ",
           kind);
    if (length > detail::kMaxFramePayload)
      fail(where(), "malformed frame from ", who(r, s.fd()), " while waiting for ", what, ": it announces ", length,
           " payload bytes, over the limit of ", detail::kMaxFramePayload);
    detail::Frame f;
    f.kind = static_cast<Kind>(kind);
    f.seq = detail::get_u64(h + 8);
    f.arg = detail::get_u64(h + 16);
    f.payload.resize(static_cast<std::size_t>(length));
    recv_bytes(s.fd(), f.payload.data(), f.payload.size(), deadline, r, what);
    return f;
  }

  static std::string hex(const std::uint8_t* p, std::size_t n) {
    static constexpr char digits[] = "0123456789abcdef";
    std::string out;
    for (std::size_t i = 0; i < n; ++i) {
      out += digits[p[i] >> 4];
      out += digits[p[i] & 15];
    }
    return out;
  }

  /// The frame rank `from` sent is the one this rank's operation expects.
  void expect(const detail::Frame& f, Kind kind, std::uint64_t seq, std::uint64_t arg, int from) const {
    if (f.kind == Kind::error && from == 0 && rank_ != 0)
      fail(where(), "rank 0 failed during ", op_name(kind, seq), ": ", std::string(f.payload.begin(), f.payload.end()));
    if (f.kind != kind || f.seq != seq)
      fail(where(), "rank ", from, " sent ", op_name(f.kind, f.seq), " while this rank is in ", op_name(kind, seq),
           ": every rank must call the same store operations in the same order");
    if (f.arg != arg)
      fail(where(), "rank ", from, " is in ", op_name(kind, seq), " with root ", f.arg, ", this rank with root ", arg);
  }

  // ---- rank 0 ----

  /// A listening socket on every interface at port_: IPv6 with IPv4 mapped, else IPv4.
  detail::Socket listen_socket() const {
    int last_err = 0;
    const char* last_call = "";
    for (const int family : {AF_INET6, AF_INET}) {
      detail::Socket s(::socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
      if (!s.valid()) {
        last_err = errno, last_call = "socket";
        continue;
      }
      const int one = 1, zero = 0;
      if (::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0)
        fail(where(), "setsockopt(SO_REUSEADDR): ", detail::errno_text(errno));
      int rc = 0;
      if (family == AF_INET6) {
        if (::setsockopt(s.fd(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero) != 0) {
          last_err = errno, last_call = "setsockopt(IPV6_V6ONLY)";
          continue;
        }
        sockaddr_in6 a{};
        a.sin6_family = AF_INET6;
        a.sin6_addr = in6addr_any;
        a.sin6_port = htons(static_cast<std::uint16_t>(port_));
        rc = ::bind(s.fd(), reinterpret_cast<const sockaddr*>(&a), sizeof a);
      } else {
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_ANY);
        a.sin_port = htons(static_cast<std::uint16_t>(port_));
        rc = ::bind(s.fd(), reinterpret_cast<const sockaddr*>(&a), sizeof a);
      }
      if (rc != 0) {
        last_err = errno, last_call = "bind";
        if (last_err == EADDRINUSE || last_err == EACCES) break;  // IPv4 would meet the same
        continue;
      }
      if (::listen(s.fd(), world_ < SOMAXCONN ? world_ : SOMAXCONN) != 0)
        fail(where(), "listen on port ", port_, ": ", detail::errno_text(errno));
      return s;
    }
    fail(where(), "cannot listen on port ", port_, ": ", last_call, ": ", detail::errno_text(last_err));
  }

  static void no_delay(int fd) {
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // latency only: failure is harmless
  }

  std::string missing_ranks() const {
    std::string out;
    int n = 0;
    for (int r = 1; r < world_; ++r)
      if (!peer(r).valid()) {
        if (n == 8) {
          out += ", ...";
          break;
        }
        out += describe(n ? ", " : "", r);
        ++n;
      }
    return out;
  }

  /// Accepts every rank's hello. A rank started for another world size fails rank 0,
  /// but rank 0 first keeps answering the ranks that still connect with the same
  /// reason, until none came for kLinger, so that every rank fails with one message.
  void accept_ranks(Clock::time_point deadline) {
    peers_.resize(static_cast<std::size_t>(world_));
    listener_ = listen_socket();
    std::string refused;  // the first world-size mismatch
    auto linger_end = deadline;
    for (int joined = 1; joined < world_ || !refused.empty();) {  // a refusal ends by the linger's timeout
      const auto until = refused.empty() ? deadline : linger_end;
      if (!wait_ready(listener_.fd(), POLLIN, until)) {
        if (!refused.empty()) throw Error(refused);
        fail(where(), "timed out after ", timeout_s(), " s waiting for rank(s) ", missing_ranks(), " to connect (",
             joined, " of ", world_, " ranks joined)");
      }
      detail::Socket s(::accept4(listener_.fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (!s.valid()) {
        if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNABORTED) continue;
        fail(where(), "accept: ", detail::errno_text(errno));
      }
      no_delay(s.fd());
      try {
        auto hello = receive(s, deadline, -1, "the hello of a connecting rank");
        const std::string from = who(-1, s.fd());
        TESSERA_CHECK(hello.kind == Kind::hello && hello.seq == 0 && hello.payload.size() == 8, where(),
                      "malformed frame from ", from, ": expected a hello (8 bytes), got ", detail::name_of(hello.kind),
                      " #", hello.seq, " of ", hello.payload.size(), " bytes");
        if (!refused.empty()) {  // told why, and not kept
          tell_failure(s.fd(), refused);
          linger_end = std::min(deadline, Clock::now() + kLinger);
          continue;
        }
        const auto r = static_cast<std::int64_t>(detail::get_u32(hello.payload.data()));
        const auto w = static_cast<std::int64_t>(detail::get_u32(hello.payload.data() + 4));
        if (w != world_) {
          refused = describe(where(), "rank ", r, " (", from, ") was started for a world of ", w, " ranks, rank 0 for ",
                             world_, ": every rank must be started with the same world size");
          tell_failure(s.fd(), refused);
          for (const auto& p : peers_) tell_failure(p.fd(), refused);
          linger_end = std::min(deadline, Clock::now() + kLinger);
          continue;
        }
        TESSERA_CHECK(r >= 1 && r < world_, where(), from, " introduces itself as rank ", r, ", outside [1, ", world_,
                      ")");
        TESSERA_CHECK(!peer(static_cast<int>(r)).valid(), where(), "two ranks introduce themselves as rank ", r,
                      " (the second from ", from, ")");
        peers_[static_cast<std::size_t>(r)] = std::move(s);
        ++joined;
      } catch (const Error& e) {
        tell_failure(s.fd(), e.what());
        throw;
      }
    }
    listener_.reset();  // every rank is here: stop accepting
    std::uint8_t w[4];
    detail::put_u32(w, static_cast<std::uint32_t>(world_));
    for (int r = 1; r < world_; ++r)
      transmit(peer(r), Kind::welcome, 0, 0, w, deadline, r, describe("sending the welcome"));
  }

  // ---- ranks 1.. ----

  void join(Clock::time_point deadline) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const std::string port = std::to_string(port_);
    const int gai = ::getaddrinfo(addr_.c_str(), port.c_str(), &hints, &found);
    if (gai != 0) fail(where(), "cannot resolve the master address \"", addr_, "\": ", ::gai_strerror(gai));
    std::string last_error = "no address";
    for (;;) {
      for (addrinfo* a = found; a && !server_.valid(); a = a->ai_next) {
        detail::Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
        if (!s.valid()) {
          last_error = describe("socket: ", detail::errno_text(errno));
          continue;
        }
        if (::connect(s.fd(), a->ai_addr, a->ai_addrlen) != 0) {
          if (errno != EINPROGRESS && errno != EINTR) {
            last_error = detail::errno_text(errno);
            continue;
          }
          if (!wait_ready(s.fd(), POLLOUT, deadline)) {
            last_error = "no answer";
            continue;
          }
          int err = 0;
          socklen_t len = sizeof err;
          if (::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
          if (err != 0) {
            last_error = detail::errno_text(err);
            continue;
          }
        }
        server_ = std::move(s);
      }
      if (server_.valid() || Clock::now() >= deadline) break;
      // Rank 0 may not listen yet: try again shortly.
      const auto pause = std::min<Clock::duration>(std::chrono::milliseconds(50), deadline - Clock::now());
      if (pause > Clock::duration::zero()) std::this_thread::sleep_for(pause);
    }
    ::freeaddrinfo(found);
    if (!server_.valid())
      fail(where(), "cannot connect to rank 0 within ", timeout_s(), " s (", last_error,
           "): is rank 0 running and listening on that address and port?");
    no_delay(server_.fd());
    std::uint8_t hello[8];
    detail::put_u32(hello, static_cast<std::uint32_t>(rank_));
    detail::put_u32(hello + 4, static_cast<std::uint32_t>(world_));
    transmit(server_, Kind::hello, 0, 0, hello, deadline, 0, "sending this rank's hello");
    auto f = receive(server_, deadline, 0, describe("rank 0 to report that all ", world_, " ranks joined"));
    if (f.kind == Kind::error)
      fail(where(), "rank 0 failed before every rank joined: ", std::string(f.payload.begin(), f.payload.end()));
    TESSERA_CHECK(f.kind == Kind::welcome && f.seq == 0 && f.payload.size() == 4, where(),
                  "malformed frame from rank 0: expected its welcome (4 bytes), got ", detail::name_of(f.kind), " #",
                  f.seq, " of ", f.payload.size(), " bytes");
    TESSERA_CHECK(detail::get_u32(f.payload.data()) == static_cast<std::uint32_t>(world_), where(),
                  "rank 0 runs a world of ", detail::get_u32(f.payload.data()), " ranks, this rank was started for ",
                  world_);
  }

  /// After a world-size mismatch, how long rank 0 waits for another rank to tell.
  static constexpr std::chrono::seconds kLinger{3};

  std::string addr_;
  int port_;
  int rank_;
  int world_;
  std::chrono::milliseconds timeout_;
  std::uint64_t seq_ = 0;
  detail::Socket listener_;            // rank 0, while ranks join
  std::vector<detail::Socket> peers_;  // rank 0: the connection of each rank (index 0 unused)
  detail::Socket server_;              // other ranks: the connection to rank 0
};

}  // namespace tessera::comm
