// Counter-based noise keys, bit for bit those of sangam/decoding/noise.py: the Triton unmasking
// kernel hashes (row key, token) the same way, so the keys packed here must match Python's.
#pragma once

#include <cstdint>

namespace sangam {

// Chris Wellons' lowbias32; uint32 wrap-around is the "& MASK32" of the Python version.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// noise.noise_key: Python masks every hash input to 32 bits, so only the low 64 bits of the
// seed and the low 32 bits of block and step matter; the callers pass them as unsigned.
inline uint32_t noise_key(uint64_t seed, uint64_t block, uint64_t step) {
  const uint32_t k = mix32(static_cast<uint32_t>(seed) ^ mix32(static_cast<uint32_t>(seed >> 32)));
  return mix32(mix32(k ^ static_cast<uint32_t>(block)) ^ static_cast<uint32_t>(step));
}

// noise.row_key: one logits row's key from its step key and position within the block.
inline uint32_t row_key(uint32_t key, uint64_t pos_in_block) {
  return mix32(key ^ mix32(static_cast<uint32_t>(pos_in_block)));
}

}  // namespace sangam
