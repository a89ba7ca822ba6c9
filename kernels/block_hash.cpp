// raykv's chained block hashes in one native call (raykv/blocks/hashing.py defines them; this
// file computes the same bytes, it defines nothing), and the host's row sums (row_sum.h defines
// them; raykv.tiers.checksum calls them) and paged copies that take them as they copy
// (raykv.ops.reference's host path), and an engine's probe of its node's index replica
// (raykv/service/node/replica.py defines the table), which share this build.
//
// Hash i = sha256(tag + tokens(i) + tail + hash(i - 1)): the Python loop spent ~0.6 us per
// block on interpreter work around two sha256 compressions. Here one call reads the token ids,
// runs every block's sha256 and returns the digests (2048 blocks of 16 tokens from a list:
// ~0.13 ms as one bytes object against ~1.35 ms on a 2.45 GHz EPYC (Zen 3) with SHA-NI).
//
// The parent comes last, so a row's whole 64-byte chunks (a 16-token row's first) do not
// depend on the chain: their sha256 state, the midstate, is computed off it, and only the rest
// (the row's last bytes, the parent, the padding: one compression for a 16-token row) runs on
// it. On x86 with the SHA extensions (checked at import) this file runs its own compression,
// two at once: block b's last in lockstep with block b + 1's midstate, step by step, so the
// two take about the time of one (a chain of sha256rnds2 alone leaves the unit idle half the
// time): ~0.10 ms for 2048 blocks from a uint32 array, where v2's chain (parent first, both
// compressions on it) took ~0.21 ms. The parent never goes through memory there: its bytes
// are gathered from the state registers into the next message's words.
//
// Elsewhere sha256 is OpenSSL's libcrypto, the one CPython's _hashlib (hashlib.sha256) already
// runs: its assembly picks SHA-NI / AVX2 / ARMv8 at run time. A call hashes one message, so no
// midstate runs under another block's compression there (the out-of-order window holds about
// one: calls interleaved over a ring of blocks took as long as calls in turn). The message of
// a block has a fixed length, so its sha256 padding is written once into a template and each
// block is SHA256_Update over whole 64-byte blocks (the midstate, then the rest), after
// which the state words are the digest: no SHA256_Final (with it a prototype of the chain took
// 40 % longer).
//
// No OpenSSL headers are needed to build this (a machine without libssl-dev builds it): the
// two functions and SHA256_CTX are declared below, with the layout OpenSSL has had since 0.9.8
// (1.1 and 3.x alike; 3.x marks these low-level calls deprecated but exports them, and one
// that did not would fail the import). PyInit checks the result on FIPS 180-2's one- and
// two-block vectors, and the SHA-NI chain against libcrypto's, so a library (or a compression)
// that disagrees makes the import fail: Python hashes then.
//
// Built by raykv/blocks/hashing.py (plain `c++`, Python's headers, linked against the
// libcrypto _hashlib loaded); no torch, so raykv.blocks stays free of it.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "row_sum.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define RAYKV_SHANI 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define RAYKV_SHANI 0
#endif

#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

extern "C" {
// OpenSSL's SHA256_CTX (sha.h: SHA_LONG h[8], Nl, Nh, data[16]; unsigned int num, md_len).
// The union leaves room should a build ever grow the struct; only h is read here.
typedef union {
    struct {
        uint32_t h[8];
        uint32_t Nl, Nh;
        uint32_t data[16];
        unsigned int num, md_len;
    } s;
    unsigned char room[256];
} raykv_sha256_ctx;
int SHA256_Init(raykv_sha256_ctx* c);
int SHA256_Update(raykv_sha256_ctx* c, const void* data, size_t len);
}

namespace {

constexpr Py_ssize_t kDigest = 32;
constexpr uint8_t kNarrow = 0x05, kWide = 0x06;  // hashing.py's row tags
// Ids from a buffer are hashed without the GIL from this many message bytes on, hashlib's own
// rule (it releases from 2 KiB): below it the release and re-acquire cost more than they free.
constexpr size_t kReleaseGilBytes = 2048;

// One message layout: tag, tokens, tail (the row), the parent digest, then sha256's padding
// for exactly this length. Every block of a layout differs only in the tokens and the parent,
// and the parent comes last: the row's whole 64-byte chunks (`lead` bytes) are the block's
// own, so their sha256 state (the midstate) is computed off the chain, and only the rest
// (`padded - lead` bytes, one or two chunks: the row's remainder, the parent, the padding)
// waits for the parent.
struct Layout {
    uint8_t* buf = nullptr;  // the parent's bytes stay zero here on the SHA-NI path
    size_t at = 0;           // the row's length: where the parent goes
    size_t lead = 0;         // the row's whole 64-byte chunks
    size_t padded = 0;       // the whole message, padded: whole 64-byte chunks
};

typedef uint32_t u32x4 __attribute__((vector_size(16)));

size_t padded_len(size_t len) { return (len + 1 + 8 + 63) / 64 * 64; }

void init_layout(Layout& m, uint8_t* buf, uint8_t tag, size_t token_bytes, const uint8_t* tail,
                 size_t tail_len) {
    m.at = 1 + token_bytes + tail_len;
    size_t len = m.at + kDigest;
    m.buf = buf;
    m.lead = m.at / 64 * 64;
    m.padded = padded_len(len);
    std::memset(buf, 0, m.padded);
    buf[0] = tag;
    std::memcpy(buf + 1 + token_bytes, tail, tail_len);
    buf[len] = 0x80;
    uint64_t bits = static_cast<uint64_t>(len) * 8;
    for (int k = 0; k < 8; ++k) buf[m.padded - 1 - k] = static_cast<uint8_t>(bits >> (8 * k));
}

// The rows are little-endian: on such a host (x86, ARM) a token is stored as it is. A
// big-endian host fails to build this, and hashes in Python.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "raykv_block_hash: little-endian only");

inline void store_le32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

inline void store_le64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }

// The digest of a finished sha256 state (its state words, big-endian) into out[0..32).
inline void store_digest(const raykv_sha256_ctx& c, uint8_t* out) {
    // Swapped 16 bytes at a time (SSE2 / NEON via GCC's vector extension) and stored as such:
    // the next block loads these bytes right away, and a load cannot be forwarded from several
    // narrower stores (8 word stores cost ~15 % of the chain's time in stalls).
    for (int half = 0; half < 2; ++half) {
        u32x4 v;
        std::memcpy(&v, c.s.h + 4 * half, 16);
        v = (v >> 24) | ((v >> 8) & 0xff00u) | ((v << 8) & 0xff0000u) | (v << 24);
        std::memcpy(out + 16 * half, &v, 16);
    }
}

// The message layouts, reused across calls (one set per thread: a call may run without the
// GIL).
struct Scratch {
    uint8_t* p = nullptr;
    size_t cap = 0;
    ~Scratch() { std::free(p); }
    uint8_t* get(size_t n) {
        if (n > cap) {
            uint8_t* q = static_cast<uint8_t*>(std::realloc(p, n));
            if (q == nullptr) return nullptr;
            p = q;
            cap = n;
        }
        return p;
    }
};
thread_local Scratch t_msgs;

// One token id of a list / tuple as int64; false (nothing raised) if it is not an int or does
// not fit int64: the caller's Python path then decides (it raises InvalidInput or hashes).
inline bool read_id(PyObject* o, int64_t* out) {
    // An exact int below 2**30 is one digit (any real vocabulary): read it without a call. Its
    // type is compared first, so no second dependent load (tp_flags) waits on the object's.
#if PY_VERSION_HEX >= 0x030C0000
    PyLongObject* i = reinterpret_cast<PyLongObject*>(o);
    if (Py_IS_TYPE(o, &PyLong_Type) && PyUnstable_Long_IsCompact(i)) {
        *out = PyUnstable_Long_CompactValue(i);
        return true;
    }
#else
    if (Py_IS_TYPE(o, &PyLong_Type) && (Py_SIZE(o) == 0 || Py_SIZE(o) == 1)) {
        *out = Py_SIZE(o) ? reinterpret_cast<PyLongObject*>(o)->ob_digit[0] : 0;
        return true;
    }
#endif
    if (!PyLong_Check(o)) return false;  // a float, a numpy scalar, ...: Python decides
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);  // runs no Python code on an int
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return false;
    }
    *out = v;
    return true;
}

// A block in flight: its message, in one of a narrow and a wide layout.
struct Slot {
    Layout* m = nullptr;
    Layout narrow, wide;
};
// Blocks b (its final compression), b + 1 (its midstate) and b + 2 (its row being packed) are
// in flight at once; a power of two.
constexpr int kSlots = 4;

// The message layouts of a call: a ring of slots (narrow / wide rows), and the first block's
// with the salt.
struct Layouts {
    Slot slot[kSlots];
    Layout first_narrow, first_wide;
    bool salted = false;  // block 0 ends in the salt's tail
};

struct Ids {  // where the ids come from: a list / tuple's items, or a uint32 / int64 buffer
    PyObject* const* items = nullptr;
    const uint32_t* ids32 = nullptr;
    const int64_t* ids64 = nullptr;
};

// Block b's tokens written into its layout (chosen by the block's width; the slot's, or the
// salted first block's), which slot s then holds; false if an id of a list is not an int64
// (ids.items: read only with the GIL). Each source has its own tight loop: the fewer
// instructions per id, the more of them the CPU runs under the chain's sha256 rounds (one
// long dependency chain that leaves the ALUs idle).
inline bool pack_block(Layouts& l, Slot& s, Py_ssize_t b, const Ids& ids, Py_ssize_t bs) {
    bool first = b == 0 && l.salted;
    Layout* m = first ? &l.first_narrow : &s.narrow;
    uint8_t* p = m->buf + 1;
    s.m = m;
    if (ids.ids32 != nullptr) {  // little-endian: the array's bytes are the row's
        std::memcpy(p, ids.ids32 + b * bs, 4 * bs);
        return true;
    }
    // Packed narrow as the ids are read (the usual block), repacked wide if one does not fit:
    // the block is narrow iff every id is in 0 .. 2**32 - 1.
    uint64_t high = 0;
    if (ids.items != nullptr) {
        PyObject* const* items = ids.items + b * bs;
        for (Py_ssize_t j = 0; j < bs; ++j) {
            int64_t v;
            if (!read_id(items[j], &v)) return false;
            high |= static_cast<uint64_t>(v) >> 32;
            store_le32(p + 4 * j, static_cast<uint32_t>(v));
        }
        if (high == 0) return true;
        s.m = m = first ? &l.first_wide : &s.wide;
        p = m->buf + 1;
        for (Py_ssize_t j = 0; j < bs; ++j) {  // read again: rare, and nothing kept meanwhile
            int64_t v = 0;
            read_id(items[j], &v);  // read fine a moment ago, and no Python code ran since
            store_le64(p + 8 * j, static_cast<uint64_t>(v));
        }
        return true;
    }
    const int64_t* t = ids.ids64 + b * bs;
    for (Py_ssize_t j = 0; j < bs; ++j) {
        high |= static_cast<uint64_t>(t[j]) >> 32;
        store_le32(p + 4 * j, static_cast<uint32_t>(t[j]));
    }
    if (high == 0) return true;
    s.m = m = first ? &l.first_wide : &s.wide;
    p = m->buf + 1;
    for (Py_ssize_t j = 0; j < bs; ++j) store_le64(p + 8 * j, static_cast<uint64_t>(t[j]));
    return true;
}

// The chain through libcrypto's SHA256_Update, block after block: the midstate of a block's
// leading chunks, then the parent put in and the rest. Each call is one serial run of
// compressions, so one block's midstate cannot run under another's final compression (the
// out-of-order window holds about one compression: run ahead in a ring of slots, it took as
// long as this): used where the SHA-NI path below is not.
template <typename Emit>
inline bool run_chain_libcrypto(Layouts& l, const Ids& ids, Py_ssize_t n, Py_ssize_t bs,
                                uint8_t* prev, Emit emit) {
    raykv_sha256_ctx fresh, c;
    SHA256_Init(&fresh);
    c = fresh;  // its counters and buffer stay as they are: whole chunks only
    Slot& s = l.slot[0];
    for (Py_ssize_t b = 0; b < n; ++b) {
        if (!pack_block(l, s, b, ids, bs)) return false;
        Layout* m = s.m;
        std::memcpy(c.s.h, fresh.s.h, sizeof c.s.h);
        if (m->lead) SHA256_Update(&c, m->buf, m->lead);
        std::memcpy(m->buf + m->at, prev, kDigest);
        SHA256_Update(&c, m->buf + m->lead, m->padded - m->lead);
        store_digest(c, prev);
        if (!emit(b, prev)) return false;
    }
    return true;
}

#if RAYKV_SHANI
// --- the chain on x86's SHA extensions: two compressions interleaved ------------------------
//
// The chain's last compressions are one dependency chain (each of a chunk's 32 sha256rnds2
// waits for the one before), which leaves the SHA unit idle much of the time. The next block's
// midstate is independent of it: compressed in lockstep with it, step by step, the two take
// about the time of one (2048 blocks of 16 tokens from a uint32 array: ~0.10 ms; the same two
// compressions one after the other, inlined, ~0.135 ms; through libcrypto ~0.22 ms).
// libcrypto cannot do this (one message per call), so this path runs its own compression, the
// one of Intel's SHA extensions guide; the import checks it against libcrypto (self_test) and
// the tests against hashlib.

#define RAYKV_SHA_TARGET __attribute__((target("sha,sse4.1,ssse3")))

alignas(16) const uint32_t kK[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

// sha256's initial state, as a digest's bytes.
const uint8_t kIv[32] = {0x6a, 0x09, 0xe6, 0x67, 0xbb, 0x67, 0xae, 0x85, 0x3c, 0x6e, 0xf3,
                         0x72, 0xa5, 0x4f, 0xf5, 0x3a, 0x51, 0x0e, 0x52, 0x7f, 0x9b, 0x05,
                         0x68, 0x8c, 0x1f, 0x83, 0xd9, 0xab, 0x5b, 0xe0, 0xcd, 0x19};

// The state in the SHA extensions' two registers: abef = (h5, h4, h1, h0) and cdgh =
// (h7, h6, h3, h2), lane 0 first. Where digest word i lives: register (0: abef, 1: cdgh) and
// lane.
constexpr int kWordReg[8] = {0, 0, 1, 1, 0, 0, 1, 1};
constexpr int kWordLane[8] = {3, 2, 3, 2, 1, 0, 1, 0};

struct State {
    __m128i abef, cdgh;
};

// N independent compressions of one 64-byte chunk each (msg: its 4 lanes of big-endian
// words), every step of one next to the same step of the others.
template <int N>
RAYKV_SHA_TARGET inline void compress(State (&st)[N], __m128i (&w)[N][4]) {
    State save[N];
    for (int s = 0; s < N; ++s) save[s] = st[s];
#pragma GCC unroll 16
    for (int g = 0; g < 16; ++g) {
        const __m128i k = _mm_load_si128(reinterpret_cast<const __m128i*>(kK + 4 * g));
        for (int s = 0; s < N; ++s) {
            __m128i* v = w[s];
            if (g >= 4) {  // the schedule: w[g] from w[g - 4 .. g - 1], kept in a ring of 4
                __m128i t = _mm_alignr_epi8(v[(g - 1) & 3], v[(g - 2) & 3], 4);
                __m128i x = _mm_add_epi32(_mm_sha256msg1_epu32(v[g & 3], v[(g - 3) & 3]), t);
                v[g & 3] = _mm_sha256msg2_epu32(x, v[(g - 1) & 3]);
            }
            __m128i m = _mm_add_epi32(v[g & 3], k);
            st[s].cdgh = _mm_sha256rnds2_epu32(st[s].cdgh, st[s].abef, m);
            st[s].abef = _mm_sha256rnds2_epu32(st[s].abef, st[s].cdgh, _mm_shuffle_epi32(m, 0x0E));
        }
    }
    for (int s = 0; s < N; ++s) {
        st[s].abef = _mm_add_epi32(st[s].abef, save[s].abef);
        st[s].cdgh = _mm_add_epi32(st[s].cdgh, save[s].cdgh);
    }
}

RAYKV_SHA_TARGET inline __m128i be_words(const uint8_t* p) {  // 16 bytes as big-endian words
    const __m128i swap = _mm_set_epi8(12, 13, 14, 15, 8, 9, 10, 11, 4, 5, 6, 7, 0, 1, 2, 3);
    return _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), swap);
}

// A digest's 32 bytes as a state (the chain's first parent, and sha256's initial state).
RAYKV_SHA_TARGET inline State state_of(const uint8_t* d) {
    __m128i lo = be_words(d), hi = be_words(d + 16);          // (h0..h3), (h4..h7)
    __m128i badc = _mm_shuffle_epi32(lo, 0xB1);               // (h1, h0, h3, h2)
    __m128i hgfe = _mm_shuffle_epi32(hi, 0x1B);               // (h7, h6, h5, h4)
    return {_mm_alignr_epi8(badc, hgfe, 8), _mm_blend_epi16(hgfe, badc, 0xF0)};
}

// Byte shuffles that gather bytes of a digest from a state's two registers: for every byte t
// of `lanes` 16-byte lanes, digest byte pick(t) (or none, -1) as it sits in abef / cdgh.
template <typename Pick>
void gather_masks(uint8_t (*abef)[16], uint8_t (*cdgh)[16], int lanes, Pick pick) {
    for (int j = 0; j < lanes; ++j) {
        for (int t = 0; t < 16; ++t) {
            int k = pick(16 * j + t);
            abef[j][t] = cdgh[j][t] = 0x80;  // pshufb: a zero byte
            if (k < 0) continue;
            int word = k / 4, at = 4 * kWordLane[word] + 3 - k % 4;  // the word is big-endian
            (kWordReg[word] ? cdgh : abef)[j][t] = static_cast<uint8_t>(at);
        }
    }
}

// The gathers, made at import: the digest's bytes in order (the emitted hash), and for each
// offset of the parent in a block's final part (the row's length mod 64) the parent's bytes
// where they go in its final chunks' message words (big-endian, 4 per lane; at most 2 chunks).
struct Gather {
    alignas(16) uint8_t abef[8][16];
    alignas(16) uint8_t cdgh[8][16];
};
Gather g_out, g_parent[64];

void make_gathers() {
    gather_masks(g_out.abef, g_out.cdgh, 2, [](int t) { return t; });
    for (int from = 0; from < 64; ++from) {  // message byte i is parent byte i - from, if any
        gather_masks(g_parent[from].abef, g_parent[from].cdgh, 8, [from](int t) {
            int i = (t & ~3) + 3 - (t & 3);  // the lane holds big-endian words
            return i >= from && i < from + kDigest ? i - from : -1;
        });
    }
}

RAYKV_SHA_TARGET inline void store_state(const State& st, uint8_t* out) {
    for (int h = 0; h < 2; ++h) {
        __m128i a = _mm_load_si128(reinterpret_cast<const __m128i*>(g_out.abef[h]));
        __m128i c = _mm_load_si128(reinterpret_cast<const __m128i*>(g_out.cdgh[h]));
        __m128i v = _mm_or_si128(_mm_shuffle_epi8(st.abef, a), _mm_shuffle_epi8(st.cdgh, c));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * h), v);
    }
}

// Chunk c of the final part of a block's message (after its leading chunks): the buffer's
// words (the parent's bytes zero there) OR the parent's, straight from its state registers,
// so the chain never goes through memory.
RAYKV_SHA_TARGET inline void final_chunk(const Layout& m, int c, const State& parent,
                                         __m128i (&w)[4]) {
    const Gather& from = g_parent[m.at - m.lead];
    for (int j = 0; j < 4; ++j) {
        int lane = 4 * c + j;
        __m128i a = _mm_load_si128(reinterpret_cast<const __m128i*>(from.abef[lane]));
        __m128i g = _mm_load_si128(reinterpret_cast<const __m128i*>(from.cdgh[lane]));
        __m128i p = _mm_or_si128(_mm_shuffle_epi8(parent.abef, a),
                                 _mm_shuffle_epi8(parent.cdgh, g));
        w[j] = _mm_or_si128(be_words(m.buf + m.lead + 16 * lane), p);
    }
}

RAYKV_SHA_TARGET inline void load_chunk(const uint8_t* p, __m128i (&w)[4]) {
    for (int j = 0; j < 4; ++j) w[j] = be_words(p + 16 * j);
}

// The chain: block b's final compressions (on the chain) in lockstep with block b + 1's
// leading ones (its midstate, off it), while block b + 2's row is packed: its stores land
// long before the loads of its compression (a load that spans several pending narrower stores
// waits for them). emit(b, digest) for every block in turn; false if an id of a list is not
// an int64 or emit failed.
template <typename Emit>
RAYKV_SHA_TARGET bool run_chain_shani(Layouts& l, const Ids& ids, Py_ssize_t n, Py_ssize_t bs,
                                      uint8_t* prev, Emit emit) {
    const State iv = state_of(kIv);
    State chain = state_of(prev), mid = iv;  // the parent; block b's midstate
    constexpr Py_ssize_t kMask = kSlots - 1;
    for (Py_ssize_t b = 0; b < n && b < 2; ++b) {
        if (!pack_block(l, l.slot[b], b, ids, bs)) return false;
    }
    if (n > 0) {  // block 0's midstate alone
        const Layout& m = *l.slot[0].m;
        for (size_t c = 0; c < m.lead; c += 64) {
            State one[1] = {mid};
            __m128i w[1][4];
            load_chunk(m.buf + c, w[0]);
            compress<1>(one, w);
            mid = one[0];
        }
    }
    for (Py_ssize_t b = 0; b < n; ++b) {
        if (b + 2 < n && !pack_block(l, l.slot[(b + 2) & kMask], b + 2, ids, bs)) return false;
        const Layout& m = *l.slot[b & kMask].m;
        const Layout* next = b + 1 < n ? l.slot[(b + 1) & kMask].m : nullptr;
        int fin = static_cast<int>((m.padded - m.lead) / 64);
        int lead = next != nullptr ? static_cast<int>(next->lead / 64) : 0;
        State st[2] = {mid, iv};  // block b's final compressions, block b + 1's leading ones
        for (int c = 0; c < fin || c < lead; ++c) {
            __m128i w[2][4];
            if (c < fin && c < lead) {
                final_chunk(m, c, chain, w[0]);
                load_chunk(next->buf + 64 * c, w[1]);
                compress<2>(st, w);
            } else if (c < fin) {
                State one[1] = {st[0]};
                __m128i w1[1][4];
                final_chunk(m, c, chain, w1[0]);
                compress<1>(one, w1);
                st[0] = one[0];
            } else {
                State one[1] = {st[1]};
                __m128i w1[1][4];
                load_chunk(next->buf + 64 * c, w1[0]);
                compress<1>(one, w1);
                st[1] = one[0];
            }
        }
        chain = st[0];
        mid = st[1];
        store_state(chain, prev);
        if (!emit(b, prev)) return false;
    }
    return true;
}

bool has_shani() {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_SSSE3) || !(c & bit_SSE4_1)) return false;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & bit_SHA);
}
#endif  // RAYKV_SHANI

// Whether the chain runs on the SHA extensions: decided at import (the CPU has them, and the
// self-test passed on them), else libcrypto.
bool g_shani = false;

template <typename Emit>
inline bool run_chain(Layouts& l, const Ids& ids, Py_ssize_t n, Py_ssize_t bs, uint8_t* prev,
                      Emit emit) {
#if RAYKV_SHANI
    if (g_shani) return run_chain_shani(l, ids, n, bs, prev, emit);
#endif
    return run_chain_libcrypto(l, ids, n, bs, prev, emit);
}

// A call's layouts, in this thread's scratch: each slot's narrow and wide one (a narrow one
// fits a wide's room), then the salted first block's (ftail: its tail, or nullptr). False if
// out of memory.
bool setup(Layouts& l, Py_ssize_t n, Py_ssize_t bs, const uint8_t* tail, size_t tail_len,
           const uint8_t* ftail, size_t ftail_len) {
    size_t wide_len = padded_len(1 + 8 * bs + tail_len + kDigest);
    size_t fwide_len = padded_len(1 + 8 * bs + ftail_len + kDigest);
    uint8_t* msgs = t_msgs.get(2 * kSlots * wide_len + 2 * fwide_len);
    if (msgs == nullptr) return false;
    for (int k = 0; k < kSlots && k < n; ++k) {  // the slots this call uses
        Slot& s = l.slot[k];
        init_layout(s.narrow, msgs + 2 * k * wide_len, kNarrow, 4 * bs, tail, tail_len);
        init_layout(s.wide, msgs + (2 * k + 1) * wide_len, kWide, 8 * bs, tail, tail_len);
    }
    if (ftail != nullptr) {
        uint8_t* f = msgs + 2 * kSlots * wide_len;
        l.salted = true;
        init_layout(l.first_narrow, f, kNarrow, 4 * bs, ftail, ftail_len);
        init_layout(l.first_wide, f + fwide_len, kWide, 8 * bs, ftail, ftail_len);
    }
    return true;
}

// The chain holding the GIL: each block's ids read, hashed and made a bytes object in turn,
// so the reads and the allocations run under the sha256 rounds. Reading every id first to
// release the GIL over the hashing alone took 0.29 ms for 2048 blocks of a list against 0.24
// here, so a list is hashed this way. None (nothing raised) if an id is not an int64.
PyObject* chain_holding_gil(Layouts& l, const Ids& ids, Py_ssize_t n, Py_ssize_t bs,
                            uint8_t* prev) {
    PyObject* out = PyList_New(n);
    if (out == nullptr) return nullptr;
    bool failed = false;  // a bytes object could not be made (MemoryError is set)
    bool ok = run_chain(l, ids, n, bs, prev, [&](Py_ssize_t b, const uint8_t* d) {
        PyObject* h = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(d), kDigest);
        if (h == nullptr) return !(failed = true);
        PyList_SET_ITEM(out, b, h);
        return true;
    });
    if (ok) return out;
    Py_DECREF(out);
    if (failed) return nullptr;
    Py_RETURN_NONE;
}

// The chain of a buffer's ids with the GIL released while it hashes (another thread runs
// meanwhile, for ~2 % more time: there is nothing to read from Python objects): the bytes
// objects are made first, with the GIL, then every block is hashed straight into its own. The
// list and its bytes are this call's alone until it returns, so no other thread sees them.
PyObject* chain_releasing_gil(Layouts& l, const Ids& ids, Py_ssize_t n, Py_ssize_t bs,
                              uint8_t* prev) {
    PyObject* out = PyList_New(n);
    if (out == nullptr) return nullptr;
    for (Py_ssize_t b = 0; b < n; ++b) {
        PyObject* d = PyBytes_FromStringAndSize(nullptr, kDigest);
        if (d == nullptr) {
            Py_DECREF(out);
            return nullptr;
        }
        PyList_SET_ITEM(out, b, d);
    }
    Py_BEGIN_ALLOW_THREADS
    run_chain(l, ids, n, bs, prev, [&](Py_ssize_t b, const uint8_t* d) {
        std::memcpy(PyBytes_AS_STRING(PyList_GET_ITEM(out, b)), d, kDigest);
        return true;
    });
    Py_END_ALLOW_THREADS
    return out;
}

// The chain as one bytes object of n * 32 bytes (a lookup's form: no object per block, no
// join), the GIL released over the hashing where the ids are a buffer's.
PyObject* chain_joined(Layouts& l, const Ids& ids, Py_ssize_t n, Py_ssize_t bs, uint8_t* prev,
                       bool release) {
    PyObject* out = PyBytes_FromStringAndSize(nullptr, n * kDigest);
    if (out == nullptr) return nullptr;
    uint8_t* dst = reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(out));
    auto emit = [&](Py_ssize_t b, const uint8_t* d) {
        std::memcpy(dst + b * kDigest, d, kDigest);
        return true;
    };
    bool ok = true;
    if (release) {
        Py_BEGIN_ALLOW_THREADS
        run_chain(l, ids, n, bs, prev, emit);
        Py_END_ALLOW_THREADS
    } else {
        ok = run_chain(l, ids, n, bs, prev, emit);
    }
    if (ok) return out;
    Py_DECREF(out);
    Py_RETURN_NONE;
}

PyObject* chain(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 7 && nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "chain(tokens, start, n, bs, parent, tail, first_tail[, joined]) takes 7 "
                        "or 8 arguments");
        return nullptr;
    }
    const int joined = nargs == 8 ? PyObject_IsTrue(args[7]) : 0;
    if (joined < 0) return nullptr;
    PyObject *tokens = args[0], *parent_obj = args[4], *tail_obj = args[5], *first_obj = args[6];
    Py_ssize_t start = PyLong_AsSsize_t(args[1]), n = PyLong_AsSsize_t(args[2]),
               bs = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred()) return nullptr;
    if (!PyBytes_Check(parent_obj) || PyBytes_GET_SIZE(parent_obj) != kDigest ||
        !PyBytes_Check(tail_obj) || (first_obj != Py_None && !PyBytes_Check(first_obj)) ||
        start < 0 || n < 0 || bs < 1) {
        PyErr_SetString(PyExc_TypeError, "chain: bad arguments");
        return nullptr;
    }
    const uint8_t* tail = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(tail_obj));
    size_t tail_len = PyBytes_GET_SIZE(tail_obj);
    const uint8_t* ftail = nullptr;
    size_t ftail_len = 0;
    if (first_obj != Py_None) {
        ftail = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(first_obj));
        ftail_len = PyBytes_GET_SIZE(first_obj);
    }
    Layouts l;
    if (!setup(l, n, bs, tail, tail_len, ftail, ftail_len)) return PyErr_NoMemory();
    uint8_t prev[kDigest];
    std::memcpy(prev, PyBytes_AS_STRING(parent_obj), kDigest);

    Ids ids;
    if (PyList_Check(tokens) || PyTuple_Check(tokens)) {
        if (start + n * bs > PySequence_Fast_GET_SIZE(tokens)) {
            PyErr_SetString(PyExc_IndexError, "chain: fewer tokens than blocks");
            return nullptr;
        }
        ids.items = PySequence_Fast_ITEMS(tokens) + start;
        if (joined) return chain_joined(l, ids, n, bs, prev, false);
        return chain_holding_gil(l, ids, n, bs, prev);
    }
    Py_buffer view;  // held until the chain is done (numpy then refuses to resize the array)
    if (PyObject_GetBuffer(tokens, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return nullptr;
    const char* f = view.format;
    if (f[0] == '<' || f[0] == '=' || f[0] == '@') ++f;
    bool u32 = view.itemsize == 4 && (std::strcmp(f, "I") == 0 || std::strcmp(f, "L") == 0);
    bool i64 = view.itemsize == 8 && (std::strcmp(f, "l") == 0 || std::strcmp(f, "q") == 0);
    if ((!u32 && !i64) || view.ndim > 1 || start + n * bs > view.len / view.itemsize) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError,
                        "chain: tokens must be a list, a tuple or a 1-D uint32 / int64 buffer "
                        "holding the blocks");
        return nullptr;
    }
    if (u32) ids.ids32 = static_cast<const uint32_t*>(view.buf) + start;
    else ids.ids64 = static_cast<const int64_t*>(view.buf) + start;
    bool release = static_cast<size_t>(n) * l.slot[0].narrow.padded >= kReleaseGilBytes;
    PyObject* out = joined    ? chain_joined(l, ids, n, bs, prev, release)
                    : release ? chain_releasing_gil(l, ids, n, bs, prev)
                              : chain_holding_gil(l, ids, n, bs, prev);
    PyBuffer_Release(&view);
    return out;
}

// --- row sums: raykv's checksum of a row (kernels/row_sum.h), for the host's copies ---------
//
// One kernel (`sum_words`) mixes and adds a run of a row's whole words and, in a copy, writes
// each word where it goes as it reads it: a paged copy with sums (`copy_rows`) reads every
// byte once, where a copy and then a sum read it twice (the sum at best from cache). On
// x86-64 with AVX2 it mixes four words per instruction, the 64-bit multiply by the odd
// constant being AVX2's 32 x 32 -> 64-bit multiplies (three: the high halves' product never
// reaches the low 64 bits); without AVX2, four words a step on four accumulators, so the
// multiplies overlap. On the 2-core box (2.45 GHz EPYC; best of noisy runs): rows in L1, AVX2
// sums ~0.5-0.8 ns a word where the scalar loop takes ~1.4; from memory, a copy that takes
// AVX2 sums runs at memcpy's pace, a copy then a scalar sum at ~0.4 x it, and a thread sums
// ~10 GB/s of rows at rest (the scalar loop ~4.7).

#if defined(__x86_64__)
bool has_avx2() {
    static const bool yes = (__builtin_cpu_init(), __builtin_cpu_supports("avx2"));
    return yes;
}
#endif

constexpr uint64_t kKeyStep = RAYKV_ROW_SUM_KEY_MUL;  // raykv_word_key(j + 1) - raykv_word_key(j)

// The terms of n whole words of src from word key `key` on (the next word's key is key +
// kKeyStep), summed; with Copy each word also written to dst as it is read.
template <bool Copy>
uint64_t words_scalar(uint8_t* dst, const uint8_t* src, size_t n, uint64_t key) {
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    size_t j = 0;
    for (; j + 4 <= n; j += 4, key += 4 * kKeyStep) {
        uint64_t x[4];
        std::memcpy(x, src + 8 * j, sizeof x);
        if (Copy) std::memcpy(dst + 8 * j, x, sizeof x);
        a0 += raykv_word_mix(x[0], key);
        a1 += raykv_word_mix(x[1], key + kKeyStep);
        a2 += raykv_word_mix(x[2], key + 2 * kKeyStep);
        a3 += raykv_word_mix(x[3], key + 3 * kKeyStep);
    }
    for (; j < n; ++j, key += kKeyStep) {
        uint64_t x;
        std::memcpy(&x, src + 8 * j, sizeof x);
        if (Copy) std::memcpy(dst + 8 * j, &x, sizeof x);
        a0 += raykv_word_mix(x, key);
    }
    return a0 + a1 + a2 + a3;
}

#if defined(__x86_64__)
// raykv_word_mix of four words: z = x + key; z ^= z >> 32; z *= MIX; z ^ (z >> 32). After the
// first xor z's high half is still `hi` (z >> 32 before it), so the 64-bit product is
// lo(z) * lo(MIX) + ((hi * lo(MIX) + lo(z) * hi(MIX)) << 32): three vpmuludq.
__attribute__((target("avx2"))) inline __m256i mix4(__m256i x, __m256i key) {
    const __m256i mix_lo = _mm256_set1_epi64x(RAYKV_ROW_SUM_MIX & 0xFFFFFFFFull);
    const __m256i mix_hi = _mm256_set1_epi64x(RAYKV_ROW_SUM_MIX >> 32);
    __m256i z = _mm256_add_epi64(x, key);
    const __m256i hi = _mm256_srli_epi64(z, 32);
    z = _mm256_xor_si256(z, hi);
    const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(hi, mix_lo), _mm256_mul_epu32(z, mix_hi));
    z = _mm256_add_epi64(_mm256_mul_epu32(z, mix_lo), _mm256_slli_epi64(cross, 32));
    return _mm256_xor_si256(z, _mm256_srli_epi64(z, 32));
}

// words_scalar, eight words a step in two vectors (two chains of multiplies in flight). With
// Stream the vector stores bypass the cache (the caller checked dst is 8-byte aligned; whole
// words go one by one until it is 32-byte aligned): a large copy's destination is not read
// soon, and a cached store first reads every line it writes.
template <bool Copy, bool Stream>
__attribute__((target("avx2"))) uint64_t words_avx2(uint8_t* dst, const uint8_t* src, size_t n,
                                                    uint64_t key) {
    uint64_t sum = 0;
    if (Stream) {
        size_t lead = (32 - reinterpret_cast<uintptr_t>(dst) % 32) % 32 / 8;
        lead = lead < n ? lead : n;
        sum = words_scalar<Copy>(dst, src, lead, key);
        dst += 8 * lead, src += 8 * lead, n -= lead, key += lead * kKeyStep;
    }
    __m256i k0 = _mm256_set_epi64x(static_cast<long long>(key + 3 * kKeyStep),
                                   static_cast<long long>(key + 2 * kKeyStep),
                                   static_cast<long long>(key + kKeyStep),
                                   static_cast<long long>(key));
    const __m256i half = _mm256_set1_epi64x(static_cast<long long>(4 * kKeyStep));
    const __m256i step = _mm256_set1_epi64x(static_cast<long long>(8 * kKeyStep));
    __m256i k1 = _mm256_add_epi64(k0, half);
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    size_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 8 * j));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 8 * j + 32));
        if (Copy && Stream) {
            _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 8 * j), x0);
            _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 8 * j + 32), x1);
        } else if (Copy) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8 * j), x0);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8 * j + 32), x1);
        }
        a0 = _mm256_add_epi64(a0, mix4(x0, k0));
        a1 = _mm256_add_epi64(a1, mix4(x1, k1));
        k0 = _mm256_add_epi64(k0, step);
        k1 = _mm256_add_epi64(k1, step);
    }
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(a0, a1));
    sum += lanes[0] + lanes[1] + lanes[2] + lanes[3];
    uint8_t* rest = Copy ? dst + 8 * j : nullptr;  // (no arithmetic on a null dst)
    return sum + words_scalar<Copy>(rest, src + 8 * j, n - j, key + j * kKeyStep);
}
#endif

// The terms of n whole words of src from word key `key` on, summed; copied to dst as they are
// read where dst is not null (`stream`: the stores may bypass the cache).
uint64_t sum_words(uint8_t* dst, const uint8_t* src, size_t n, uint64_t key, bool stream) {
#if defined(__x86_64__)
    if (has_avx2()) {
        if (dst == nullptr) return words_avx2<false, false>(dst, src, n, key);
        if (stream && reinterpret_cast<uintptr_t>(dst) % 8 == 0) {
            return words_avx2<true, true>(dst, src, n, key);
        }
        return words_avx2<true, false>(dst, src, n, key);
    }
#endif
    (void)stream;
    return dst == nullptr ? words_scalar<false>(dst, src, n, key)
                          : words_scalar<true>(dst, src, n, key);
}

// The terms of `bytes` bytes that start at word `word` of a row (a last partial word
// zero-padded), summed; copied to dst where it is not null.
uint64_t span_sum(uint8_t* dst, const uint8_t* src, size_t bytes, size_t word, bool stream) {
    const size_t n = bytes / 8, rest = bytes % 8;
    uint64_t sum = sum_words(dst, src, n, raykv_word_key(word), stream);
    if (rest) {
        uint64_t x = 0;  // little-endian host: the row's last bytes are the word's low bytes
        std::memcpy(&x, src + 8 * n, rest);
        if (dst != nullptr) std::memcpy(dst + 8 * n, &x, rest);
        sum += raykv_word_mix(x, raykv_word_key(word + n));
    }
    return sum;
}

// One row's sum.
uint64_t row_sum(const uint8_t* p, size_t width) { return span_sum(nullptr, p, width, 0, false); }

// row_sums(table, index, width, out): out[i] = the sum of the first `width` bytes of row
// index[i] of `table` (a 2-D uint8 buffer, each row contiguous; index and out int64 buffers of
// one length). Without the GIL from kReleaseGilBytes on: the host's copy threads sum beside
// each other and beside copies.
PyObject* row_sums(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "row_sums(table, index, width, out) takes 4 arguments");
        return nullptr;
    }
    const Py_ssize_t width = PyLong_AsSsize_t(args[2]);
    if (width == -1 && PyErr_Occurred()) return nullptr;
    Py_buffer table{}, index{}, out{};
    if (PyObject_GetBuffer(args[0], &table, PyBUF_STRIDES) != 0) return nullptr;
    if (PyObject_GetBuffer(args[1], &index, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
        PyBuffer_Release(&table);
        return nullptr;
    }
    if (PyObject_GetBuffer(args[3], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) {
        PyBuffer_Release(&table);
        PyBuffer_Release(&index);
        return nullptr;
    }
    const Py_ssize_t n = index.len / 8;
    const Py_ssize_t rows = table.ndim == 2 ? table.shape[0] : 0;
    const char* error = nullptr;
    if (table.ndim != 2 || table.itemsize != 1 || (table.shape[1] > 1 && table.strides[1] != 1) ||
        width < 0 || width > table.shape[1]) {
        error = "row_sums: table must be 2-D uint8 rows, each contiguous, at least width wide";
    } else if (index.itemsize != 8 || index.len % 8 || out.len != index.len ||
               (index.format != nullptr && index.format[0] != 'q' && index.format[0] != 'l')) {
        error = "row_sums: index and out must be int64 buffers of one length";
    }
    const int64_t* at = static_cast<const int64_t*>(index.buf);
    for (Py_ssize_t i = 0; error == nullptr && i < n; ++i) {
        if (at[i] < 0 || at[i] >= rows) error = "row_sums: a row index outside the table";
    }
    if (error == nullptr) {
        const uint8_t* base = static_cast<const uint8_t*>(table.buf);
        uint64_t* sums = static_cast<uint64_t*>(out.buf);
        const Py_ssize_t stride = table.strides[0];
        auto run = [&] {
            for (Py_ssize_t i = 0; i < n; ++i) {
                sums[i] = row_sum(base + at[i] * stride, static_cast<size_t>(width));
            }
        };
        if (static_cast<size_t>(n) * static_cast<size_t>(width) >= kReleaseGilBytes) {
            Py_BEGIN_ALLOW_THREADS run();
            Py_END_ALLOW_THREADS
        } else {
            run();
        }
    }
    PyBuffer_Release(&table);
    PyBuffer_Release(&index);
    PyBuffer_Release(&out);
    if (error != nullptr) {
        PyErr_SetString(PyExc_ValueError, error);
        return nullptr;
    }
    Py_RETURN_NONE;
}

// replica_flags(slots, hashes, first, step, group, probes, out): out[j] = the flags of the key
// of hash first + j * step of `hashes` (32-byte block hashes one after another) in group
// `group` (its id + 1) in an index replica's slot words `slots` (a power-of-two count), found
// as raykv/service/node/replica.py's ReplicaReader.flags finds them (that file defines the
// table; this is its probe in one pass): the hash's first two 8-byte lanes with the group
// folded in are the key's fingerprint (its low 8 bits the flags' place; 0 is an unused slot)
// and its home slot, then up to `probes` slots from home until the fingerprint or an unused
// slot. The words are read once each with a relaxed atomic load: another process writes
// them, one aligned word at a time, while this reads (a stale word is a stale answer, which the
// caller's generation check and the load's own verification make a miss, never wrong KV). An
// engine's lookup of a 32k-token prompt: 2048 keys in a few tens of us, where the numpy path's
// ~15 vector steps cost ~80 us of calls.
PyObject* replica_flags(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "replica_flags(slots, hashes, first, step, group, probes, out) takes 7 "
                        "arguments");
        return nullptr;
    }
    const Py_ssize_t first = PyLong_AsSsize_t(args[2]), step = PyLong_AsSsize_t(args[3]);
    const unsigned long long group = PyLong_AsUnsignedLongLong(args[4]);
    const Py_ssize_t probes = PyLong_AsSsize_t(args[5]);
    if (PyErr_Occurred()) return nullptr;
    Py_buffer slots{}, hashes{}, out{};
    if (PyObject_GetBuffer(args[0], &slots, PyBUF_C_CONTIGUOUS) != 0) return nullptr;
    if (PyObject_GetBuffer(args[1], &hashes, PyBUF_C_CONTIGUOUS) != 0) {
        PyBuffer_Release(&slots);
        return nullptr;
    }
    if (PyObject_GetBuffer(args[6], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) {
        PyBuffer_Release(&slots);
        PyBuffer_Release(&hashes);
        return nullptr;
    }
    const Py_ssize_t count = slots.len / 8, n = out.len;
    const char* error = nullptr;
    if (slots.len % 8 || count == 0 || (count & (count - 1)) != 0) {
        error = "replica_flags: slots must be a power-of-two count of 8-byte words";
    } else if (hashes.len % 32 || first < 0 || step < 1 || probes < 1 ||
               (n > 0 && first + (n - 1) * step >= hashes.len / 32)) {
        error = "replica_flags: out names hashes past the end of hashes";
    }
    if (error == nullptr) {
        const uint64_t* words = static_cast<const uint64_t*>(slots.buf);
        const uint8_t* h = static_cast<const uint8_t*>(hashes.buf);
        uint8_t* flags = static_cast<uint8_t*>(out.buf);
        const uint64_t mask = static_cast<uint64_t>(count - 1);
        const uint64_t fold_fp = group * 0x9E3779B97F4A7C15ull;
        const uint64_t fold_home = group * 0xC2B2AE3D27D4EB4Full;
        for (Py_ssize_t j = 0; j < n; ++j) {
            uint64_t lanes[2];  // little-endian host: the hash's first two uint64 lanes
            std::memcpy(lanes, h + 32 * (first + j * step), 16);
            uint64_t fp = (lanes[0] ^ fold_fp) & ~0xFFull;
            if (fp == 0) fp = 1ull << 8;
            uint64_t at = (lanes[1] ^ fold_home) & mask;
            uint8_t got = 0;
            for (Py_ssize_t r = 0; r < probes; ++r) {
                const uint64_t w = __atomic_load_n(words + at, __ATOMIC_RELAXED);
                if ((w & ~0xFFull) == fp) {
                    got = static_cast<uint8_t>(w & 0xFF);
                    break;
                }
                if (w == 0) break;  // an unused slot: the key is not in the table
                at = (at + 1) & mask;
            }
            flags[j] = got;
        }
    }
    PyBuffer_Release(&slots);
    PyBuffer_Release(&hashes);
    PyBuffer_Release(&out);
    if (error != nullptr) {
        PyErr_SetString(PyExc_ValueError, error);
        return nullptr;
    }
    Py_RETURN_NONE;
}

// One entry of a paged copy: where its blocks are and where its bytes go in a row.
struct Entry {
    uint8_t* base;
    Py_ssize_t stride;  // bytes from one block to the next
    Py_ssize_t blocks;
    size_t bytes;   // of a block
    size_t offset;  // in a row: the entries before it, one after another
};

// copy_rows(rows, blocks, ids, gather, sums, lo, hi, stream): for i in lo .. hi - 1, row i of
// `rows` (a 2-D uint8 buffer, each row contiguous) and block ids[i] of every entry of `blocks`
// (a sequence of 2-D uint8 buffers [num_blocks, block bytes], each block contiguous; the row
// is the entries' blocks one after another) are copied, into the row (gather) or into the
// blocks (scatter), and with `sums` (an int64 buffer, one per row; None: a plain copy) each
// row's sum goes to sums[i], taken from the words as they are copied: the sum of the very
// bytes written. `stream`: a large copy, whose stores may bypass the cache. An entry whose
// bytes do not start a row's word (an offset not a multiple of 8) has the row summed after
// its copy instead (a second read, from cache). Without the GIL from kReleaseGilBytes on: the
// host's copy threads (raykv.ops.threads) each take a range of rows. ValueError before
// anything is copied where a buffer does not fit or an id is outside an entry's blocks.
PyObject* copy_rows(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "copy_rows(rows, blocks, ids, gather, sums, lo, hi, stream) takes 8 "
                        "arguments");
        return nullptr;
    }
    const int gather = PyObject_IsTrue(args[3]), stream = PyObject_IsTrue(args[7]);
    const Py_ssize_t lo = PyLong_AsSsize_t(args[5]), hi = PyLong_AsSsize_t(args[6]);
    if (gather < 0 || stream < 0 || PyErr_Occurred()) return nullptr;
    PyObject* seq = PySequence_Fast(args[1], "copy_rows: blocks must be a sequence of buffers");
    if (seq == nullptr) return nullptr;
    const Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    std::vector<Py_buffer> held;
    held.reserve(static_cast<size_t>(k) + 3);  // never reallocated: the pointers below hold
    auto hold = [&](PyObject* o, int flags) -> Py_buffer* {
        held.emplace_back();
        if (PyObject_GetBuffer(o, &held.back(), flags) != 0) {
            held.pop_back();
            return nullptr;
        }
        return &held.back();
    };
    auto release = [&] {
        for (Py_buffer& b : held) PyBuffer_Release(&b);
        Py_DECREF(seq);
    };
    // the side copied into must be writable; rows and blocks: 2-D bytes, each row contiguous
    auto rows_of = [](const Py_buffer* b) {
        return b->ndim == 2 && b->itemsize == 1 && (b->shape[1] <= 1 || b->strides[1] == 1);
    };
    const char* error = nullptr;
    Py_buffer* rows = hold(args[0], PyBUF_STRIDES | (gather ? PyBUF_WRITABLE : 0));
    if (rows == nullptr) return release(), nullptr;
    if (!rows_of(rows)) error = "copy_rows: rows must be 2-D uint8, each row contiguous";
    std::vector<Entry> entries(static_cast<size_t>(k));
    size_t width = 0;
    bool aligned = true;  // every entry starts a word of the row: sums fused into the copy
    Py_ssize_t blocks = PY_SSIZE_T_MAX;
    for (Py_ssize_t e = 0; error == nullptr && e < k; ++e) {
        Py_buffer* b = hold(PySequence_Fast_GET_ITEM(seq, e),
                            PyBUF_STRIDES | (gather ? 0 : PyBUF_WRITABLE));
        if (b == nullptr) return release(), nullptr;
        if (!rows_of(b)) {
            error = "copy_rows: every entry must be 2-D uint8 [blocks, bytes], each block contiguous";
            break;
        }
        entries[e] = {static_cast<uint8_t*>(b->buf), b->strides[0], b->shape[0],
                      static_cast<size_t>(b->shape[1]), width};
        aligned = aligned && width % 8 == 0;
        width += static_cast<size_t>(b->shape[1]);
        blocks = b->shape[0] < blocks ? b->shape[0] : blocks;
    }
    const Py_ssize_t n = rows->ndim == 2 ? rows->shape[0] : 0;
    if (error == nullptr && width != static_cast<size_t>(rows->shape[1])) {
        error = "copy_rows: a row must be as wide as the entries' blocks together";
    }
    Py_buffer* ids = hold(args[2], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT);
    if (ids == nullptr) return release(), nullptr;
    if (error == nullptr && (ids->itemsize != 8 || ids->len != 8 * n ||
                             (ids->format[0] != 'q' && ids->format[0] != 'l'))) {
        error = "copy_rows: ids must be an int64 buffer, one per row";
    }
    uint64_t* sums = nullptr;
    if (args[4] != Py_None) {
        Py_buffer* s = hold(args[4], PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT);
        if (s == nullptr) return release(), nullptr;
        if (error == nullptr && (s->itemsize != 8 || s->len != 8 * n ||
                                 (s->format[0] != 'q' && s->format[0] != 'l'))) {
            error = "copy_rows: sums must be an int64 buffer, one per row";
        }
        sums = static_cast<uint64_t*>(s->buf);
    }
    if (error == nullptr && !(0 <= lo && lo <= hi && hi <= n)) {
        error = "copy_rows: lo .. hi must be a range of the rows";
    }
    const int64_t* at = static_cast<const int64_t*>(ids->buf);
    for (Py_ssize_t i = lo; error == nullptr && i < hi; ++i) {
        if (at[i] < 0 || at[i] >= blocks) error = "copy_rows: a block id outside an entry's blocks";
    }
    if (error != nullptr) {
        release();
        PyErr_SetString(PyExc_ValueError, error);
        return nullptr;
    }
    uint8_t* base = static_cast<uint8_t*>(rows->buf);
    const Py_ssize_t row_stride = rows->strides[0];
    auto run = [&] {
        for (Py_ssize_t i = lo; i < hi; ++i) {
            uint8_t* row = base + i * row_stride;
            uint64_t sum = 0;
            for (const Entry& e : entries) {
                uint8_t* block = e.base + at[i] * e.stride;
                uint8_t* dst = gather ? row + e.offset : block;
                const uint8_t* src = gather ? block : row + e.offset;
                if (sums != nullptr && aligned) {
                    sum += span_sum(dst, src, e.bytes, e.offset / 8, stream);
                } else if (e.bytes) {
                    std::memcpy(dst, src, e.bytes);
                }
            }
            if (sums != nullptr) sums[i] = aligned ? sum : row_sum(row, width);
        }
#if defined(__x86_64__)
        if (stream) _mm_sfence();  // the streamed stores are visible before this call returns
#endif
    };
    if (static_cast<size_t>(hi - lo) * width >= kReleaseGilBytes) {
        Py_BEGIN_ALLOW_THREADS run();
        Py_END_ALLOW_THREADS
    } else {
        run();
    }
    release();
    Py_RETURN_NONE;
}

// The library must give sha256 as hashlib does: FIPS 180-2's one-block ("abc") and two-block
// vectors, as a block is hashed (the first chunk alone, then the rest).
const uint8_t kAbc[32] = {0xba, 0x78, 0x16, 0xbf, 0x8f, 0x01, 0xcf, 0xea, 0x41, 0x41, 0x40,
                          0xde, 0x5d, 0xae, 0x22, 0x23, 0xb0, 0x03, 0x61, 0xa3, 0x96, 0x17,
                          0x7a, 0x9c, 0xb4, 0x10, 0xff, 0x61, 0xf2, 0x00, 0x15, 0xad};
const uint8_t kTwo[32] = {0x24, 0x8d, 0x6a, 0x61, 0xd2, 0x06, 0x38, 0xb8, 0xe5, 0xc0, 0x26,
                          0x93, 0x0c, 0x3e, 0x60, 0x39, 0xa3, 0x3c, 0xe4, 0x59, 0x64, 0xff,
                          0x21, 0x67, 0xf6, 0xec, 0xed, 0xd4, 0x19, 0xdb, 0x06, 0xc1};

bool libcrypto_test() {
    const char* msgs[2] = {"abc", "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"};
    const uint8_t* want[2] = {kAbc, kTwo};
    for (int i = 0; i < 2; ++i) {
        size_t len = std::strlen(msgs[i]);
        uint8_t buf[128] = {0};
        std::memcpy(buf, msgs[i], len);
        size_t padded = padded_len(len);
        buf[len] = 0x80;
        for (int k = 0; k < 8; ++k) {
            buf[padded - 1 - k] = static_cast<uint8_t>((len * 8) >> (8 * k));
        }
        raykv_sha256_ctx c;
        SHA256_Init(&c);
        size_t lead = padded > 64 ? 64 : 0;
        if (lead) SHA256_Update(&c, buf, lead);
        SHA256_Update(&c, buf + lead, padded - lead);
        uint8_t got[kDigest];
        store_digest(c, got);
        if (std::memcmp(got, want[i], kDigest) != 0) return false;
    }
    return true;
}

#if RAYKV_SHANI
// The SHA-NI chain gives libcrypto's: "abc" through its compression, then chains of every
// shape against the libcrypto chain (narrow and wide blocks, no leading chunk or several, a
// salted first block whose final part is two chunks), from ids of both buffer kinds.
RAYKV_SHA_TARGET bool shani_test() {
    uint8_t buf[64] = {'a', 'b', 'c', 0x80};
    buf[63] = 24;
    {
        uint8_t got[kDigest];
        State st[1] = {state_of(kIv)};
        __m128i w[1][4];
        load_chunk(buf, w[0]);
        compress<1>(st, w);
        store_state(st[0], got);
        if (std::memcmp(got, kAbc, kDigest) != 0) return false;
    }
    int64_t ids64[40 * 9];
    uint32_t ids32[40 * 9];
    for (int i = 0; i < 40 * 9; ++i) {
        ids32[i] = static_cast<uint32_t>(i * 2654435761u);
        ids64[i] = i == 100 ? -5 : static_cast<int64_t>(ids32[i]);  // block 6 of 16 is wide
    }
    static const uint8_t salt[48] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    const uint8_t lora[8] = {1, 1, 0, 0, 0, 3, 0, 0};
    struct Case {
        Py_ssize_t bs, n;
        const uint8_t* tail;
        size_t tail_len;
        const uint8_t* ftail;
        size_t ftail_len;
    } cases[] = {{16, 9, lora + 6, 2, nullptr, 0}, {16, 9, lora, 8, salt, 41},
                 {1, 9, lora + 6, 2, salt, 48},    {40, 9, lora, 8, nullptr, 0},
                 {3, 9, lora, 8, salt, 9},         {16, 1, lora + 6, 2, nullptr, 0}};
    for (const Case& k : cases) {
        for (int kind = 0; kind < 2; ++kind) {
            Ids ids;
            if (kind) ids.ids32 = ids32;
            else ids.ids64 = ids64;
            uint8_t out[2][9 * kDigest];
            for (int path = 0; path < 2; ++path) {
                Layouts l;
                if (!setup(l, k.n, k.bs, k.tail, k.tail_len, k.ftail, k.ftail_len)) return false;
                uint8_t prev[kDigest] = {7};
                auto emit = [&](Py_ssize_t b, const uint8_t* d) {
                    std::memcpy(out[path] + b * kDigest, d, kDigest);
                    return true;
                };
                if (path) run_chain_shani(l, ids, k.n, k.bs, prev, emit);
                else run_chain_libcrypto(l, ids, k.n, k.bs, prev, emit);
            }
            if (std::memcmp(out[0], out[1], k.n * kDigest) != 0) return false;
        }
    }
    return true;
}
#endif

PyMethodDef methods[] = {
    {"chain", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(chain)), METH_FASTCALL,
     "chain(tokens, start, n, bs, parent, tail, first_tail) -> list[bytes] | None: the chained "
     "hashes of n blocks of bs tokens from tokens[start] (a list, a tuple, or a uint32 / int64 "
     "buffer); None where an id is not an int64 (the Python path then decides)"},
    {"row_sums", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(row_sums)),
     METH_FASTCALL,
     "row_sums(table, index, width, out): out[i] = the row sum (kernels/row_sum.h) of the first "
     "width bytes of row index[i] of the 2-D uint8 table"},
    {"copy_rows", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(copy_rows)),
     METH_FASTCALL,
     "copy_rows(rows, blocks, ids, gather, sums, lo, hi, stream): rows[i] <-> block ids[i] of "
     "every entry of blocks (one after another in a row) for i in lo .. hi - 1, each row's sum "
     "(kernels/row_sum.h) into sums[i] as it is copied"},
    {"replica_flags", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(replica_flags)),
     METH_FASTCALL,
     "replica_flags(slots, hashes, first, step, group, probes, out): out[j] = the index "
     "replica's flags of hash first + j * step's key in group `group` (raykv/service/node/"
     "replica.py)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "raykv_block_hash", nullptr, -1, methods,
                          nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_raykv_block_hash(void) {
    if (!libcrypto_test()) {
        PyErr_SetString(PyExc_ImportError,
                        "raykv_block_hash: libcrypto's SHA256 gave a wrong digest on the FIPS "
                        "180-2 vectors");
        return nullptr;
    }
#if RAYKV_SHANI
    make_gathers();
    if (has_shani()) {
        if (!shani_test()) {
            PyErr_SetString(PyExc_ImportError,
                            "raykv_block_hash: the SHA-NI chain differs from libcrypto's");
            return nullptr;
        }
        g_shani = true;
    }
#endif
    return PyModule_Create(&module_def);
}
