// CRC-32 (IEEE 802.3, the polynomial zlib and PNG use) and CRC-32C (Castagnoli, the
// one TFRecord files and iSCSI use), table-driven, eight bytes at a time.
//
// Both are reflected, with initial value and final xor 0xFFFFFFFF:
//   crc32("123456789") == 0xCBF43926, crc32c("123456789") == 0xE3069283.
// The tables (8 x 256 entries per polynomial, "slicing by 8") are built at compile
// time; a byte at a time is about 0.4 GB/s, eight at a time several times that, which
// is what checksumming a checkpoint as it is written needs. The *_update forms let a
// caller checksum data that arrives in pieces:
//   crc32_update(crc32_update(0, a), b) == crc32(a followed by b),
// and crc32_combine joins the CRCs of pieces checksummed apart (on several threads):
//   crc32_combine(crc32(a), crc32(b), size of b) == crc32(a followed by b).
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

// Polynomials over GF(2) modulo the CRC's, reflected as the CRC is: bit 31 holds x^0.
// a * b mod P, shifting b up one power of x per bit of a.
template <std::uint32_t Poly>
constexpr std::uint32_t mul_mod(std::uint32_t a, std::uint32_t b) {
  std::uint32_t product = 0;
  for (std::uint32_t bit = 1u << 31; bit != 0; bit >>= 1) {
    if (a & bit) product ^= b;
    b = (b & 1u) ? (b >> 1) ^ Poly : b >> 1;
  }
  return product;
}

// x^(8 n) mod P: appending n zero bytes multiplies a CRC's register by it. Squaring
// x^8 gives x^(8 * 2^k) for each bit k of n.
template <std::uint32_t Poly>
constexpr std::uint32_t x_pow_8n_mod(std::uint64_t n) {
  std::uint32_t result = 1u << 31;      // x^0
  std::uint32_t power = 1u << (31 - 8);  // x^8
  for (; n != 0; n >>= 1) {
    if (n & 1u) result = mul_mod<Poly>(power, result);
    power = mul_mod<Poly>(power, power);
  }
  return result;
}

// The register after a's bytes, carried over b's `size_b` bytes, is crc_a * x^(8 size_b);
// b's own CRC adds the rest (the initial and final xors cancel between the two).
template <std::uint32_t Poly>
constexpr std::uint32_t crc_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::uint64_t size_b) {
  return mul_mod<Poly>(x_pow_8n_mod<Poly>(size_b), crc_a) ^ crc_b;
}

}  // namespace detail

/// Continues the CRC-32 `crc` (of the bytes seen so far; 0 for none) over `size` more bytes.
inline std::uint32_t crc32_update(std::uint32_t crc, const void* data, std::size_t size) {
  return detail::crc_update<detail::kCrc32Poly>(crc, data, size);
}

/// The CRC-32 of `size` bytes at `data`.
inline std::uint32_t crc32(const void* data, std::size_t size) { return crc32_update(0, data, size); }

/// The CRC-32 of a byte span.
inline std::uint32_t crc32(std::span<const std::byte> bytes) { return crc32(bytes.data(), bytes.size()); }

/// The CRC-32 of a followed by b, from crc_a = crc32(a), crc_b = crc32(b) and b's size in
/// bytes: pieces checksummed apart (on several threads) joined in order.
inline constexpr std::uint32_t crc32_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::uint64_t size_b) {
  return detail::crc_combine<detail::kCrc32Poly>(crc_a, crc_b, size_b);
}

/// Continues the CRC-32C `crc` over `size` more bytes.
inline std::uint32_t crc32c_update(std::uint32_t crc, const void* data, std::size_t size) {
  return detail::crc_update<detail::kCrc32cPoly>(crc, data, size);
}

/// The CRC-32C of `size` bytes at `data`.
inline std::uint32_t crc32c(const void* data, std::size_t size) { return crc32c_update(0, data, size); }

/// The CRC-32C of a byte span.
inline std::uint32_t crc32c(std::span<const std::byte> bytes) { return crc32c(bytes.data(), bytes.size()); }

}  // namespace tessera::io
