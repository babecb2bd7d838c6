// CRC-32 (IEEE 802.3, the polynomial zlib and PNG use) and CRC-32C (Castagnoli, the
// one TFRecord files and iSCSI use), table-driven, eight bytes at a time.
//
// Both are reflected, with initial value and final xor 0xFFFFFFFF:
//   crc32("123456789") == 0xCBF43926, crc32c("123456789") == 0xE3069283.
// The tables (8 x 256 entries per polynomial, "slicing by 8") are built at compile
// time; a byte at a time is about 0.4 GB/s, eight at a time several times that, which
// is what checksumming a checkpoint as it is written needs. The *_update forms let a
// caller checksum data that arrives in pieces:
//   crc32_update(crc32_update(0, a), b) == crc32(a followed by b).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace tessera::io {

namespace detail {

template <std::uint32_t Poly>
constexpr std::array<std::array<std::uint32_t, 256>, 8> make_crc_tables() {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1u) ? (Poly ^ (c >> 1)) : (c >> 1);
    t[0][i] = c;
  }
  for (std::size_t k = 1; k < 8; ++k)
    for (std::size_t i = 0; i < 256; ++i) t[k][i] = t[0][t[k - 1][i] & 0xFFu] ^ (t[k - 1][i] >> 8);
  return t;
}

template <std::uint32_t Poly>
inline constexpr auto crc_tables = make_crc_tables<Poly>();

template <std::uint32_t Poly>
std::uint32_t crc_update(std::uint32_t crc, const void* data, std::size_t size) {
  const auto& t = crc_tables<Poly>;
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t c = crc ^ 0xFFFFFFFFu;
  for (; size >= 8; size -= 8, p += 8) {
    // Little-endian assembly of the two words, whatever the host's byte order.
    const std::uint32_t lo = c ^ (std::uint32_t{p[0]} | std::uint32_t{p[1]} << 8 | std::uint32_t{p[2]} << 16 |
                                  std::uint32_t{p[3]} << 24);
    const std::uint32_t hi =
        std::uint32_t{p[4]} | std::uint32_t{p[5]} << 8 | std::uint32_t{p[6]} << 16 | std::uint32_t{p[7]} << 24;
    c = t[7][lo & 0xFFu] ^ t[6][(lo >> 8) & 0xFFu] ^ t[5][(lo >> 16) & 0xFFu] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFFu] ^ t[2][(hi >> 8) & 0xFFu] ^ t[1][(hi >> 16) & 0xFFu] ^ t[0][hi >> 24];
  }
  for (; size > 0; --size, ++p) c = t[0][(c ^ *p) & 0xFFu] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

inline constexpr std::uint32_t kCrc32Poly = 0xEDB88320u;   // IEEE 802.3, reflected
inline constexpr std::uint32_t kCrc32cPoly = 0x82F63B78u;  // Castagnoli, reflected

}  // namespace detail

/// Continues the CRC-32 `crc` (of the bytes seen so far; 0 for none) over `size` more bytes.
inline std::uint32_t crc32_update(std::uint32_t crc, const void* data, std::size_t size) {
  return detail::crc_update<detail::kCrc32Poly>(crc, data, size);
}

/// The CRC-32 of `size` bytes at `data`.
inline std::uint32_t crc32(const void* data, std::size_t size) { return crc32_update(0, data, size); }

/// The CRC-32 of a byte span.
inline std::uint32_t crc32(std::span<const std::byte> bytes) { return crc32(bytes.data(), bytes.size()); }

/// Continues the CRC-32C `crc` over `size` more bytes.
inline std::uint32_t crc32c_update(std::uint32_t crc, const void* data, std::size_t size) {
  return detail::crc_update<detail::kCrc32cPoly>(crc, data, size);
}

/// The CRC-32C of `size` bytes at `data`.
inline std::uint32_t crc32c(const void* data, std::size_t size) { return crc32c_update(0, data, size); }

/// The CRC-32C of a byte span.
inline std::uint32_t crc32c(std::span<const std::byte> bytes) { return crc32c(bytes.data(), bytes.size()); }

}  // namespace tessera::io
