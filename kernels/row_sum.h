// The row sum: raykv's one checksum of a row of bytes, on the CPU (block_hash.cpp's row_sums),
// the GPU (paged_copy.cu: taken while a kernel copies the row) and the wire; the torch reference
// is raykv.ops.reference.row_sums. A row is read as little-endian 64-bit words x_j (a width that
// is not a multiple of 8 counts as zero-padded); its sum is the wrapping sum over j of
// raykv_word_term(x_j, j). The term is a bijection of x_j for every j (an add, then
// xor-shift, multiply by an odd constant, xor-shift: each invertible), so a change of any one
// word, any single-bit flip among them, always changes the sum. The position enters before the
// mixing, so moved or swapped words change it too, and the mixing carries a change in a word's
// high bits down into the low ones: a sum of odd-weighted words (the wire sum before this)
// missed every pair of flips of two words' top bits, which cancel as 2^63 + 2^63 = 0 mod 2^64.
// Terms add in any order, so a kernel may split a row among any threads and add their parts.
#pragma once
#include <stdint.h>

#if defined(__CUDACC__)
#define RAYKV_ROW_SUM_FN __host__ __device__ __forceinline__
#else
#define RAYKV_ROW_SUM_FN inline
#endif

#define RAYKV_ROW_SUM_KEY_MUL 0x9E3779B97F4A7C15ull
#define RAYKV_ROW_SUM_KEY_ADD 0x632BE59BD9B4E019ull
#define RAYKV_ROW_SUM_MIX 0xD6E8FEB86659FD93ull

// Word j's key: added to the word before it is mixed.
RAYKV_ROW_SUM_FN uint64_t raykv_word_key(uint64_t j) {
  return j * RAYKV_ROW_SUM_KEY_MUL + RAYKV_ROW_SUM_KEY_ADD;
}

// What word j contributes to its row's sum, given its key (raykv_word_key(j)).
RAYKV_ROW_SUM_FN uint64_t raykv_word_mix(uint64_t x, uint64_t key) {
  uint64_t z = x + key;
  z ^= z >> 32;
  z *= RAYKV_ROW_SUM_MIX;
  return z ^ (z >> 32);
}

RAYKV_ROW_SUM_FN uint64_t raykv_word_term(uint64_t x, uint64_t j) {
  return raykv_word_mix(x, raykv_word_key(j));
}
