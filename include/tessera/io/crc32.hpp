// CRC-32 (IEEE 802.3, the polynomial zlib and PNG use), table-driven.
//
// Reflected polynomial 0xEDB88320, initial value and final xor 0xFFFFFFFF, so
// crc32("123456789") == 0xCBF43926. The 256-entry table is built at compile time.
// crc32_update lets a caller checksum data that arrives in pieces:
//   crc32_update(crc32_update(0, a), b) == crc32(a followed by b).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace tessera::io {

namespace detail {

constexpr std::array<std::uint32_t, 256> make_crc32_table() {
  std::array<std::uint32_t, 256> table{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1u) ? (0xEDB88320u ^ (c >> 1)) : (c >> 1);
    table[i] = c;
  }
  return table;
}

inline constexpr std::array<std::uint32_t, 256> crc32_table = make_crc32_table();

}  // namespace detail

/// Continues the CRC-32 `crc` (of the bytes seen so far; 0 for none) over `size` more bytes.
inline std::uint32_t crc32_update(std::uint32_t crc, const void* data, std::size_t size) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  std::uint32_t c = crc ^ 0xFFFFFFFFu;
  for (std::size_t i = 0; i < size; ++i) c = detail::crc32_table[(c ^ bytes[i]) & 0xFFu] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

/// The CRC-32 of `size` bytes at `data`.
inline std::uint32_t crc32(const void* data, std::size_t size) { return crc32_update(0, data, size); }

/// The CRC-32 of a byte span.
inline std::uint32_t crc32(std::span<const std::byte> bytes) { return crc32(bytes.data(), bytes.size()); }

}  // namespace tessera::io
