// raykv's chained block hashes in one native call (raykv/blocks/hashing.py defines them; this
// file computes the same bytes, it defines nothing), and the host's row sums (row_sum.h defines
// them; raykv.tiers.checksum calls them) and paged copies that take them as they copy
// (raykv.ops_reference's host path), which share this build.
//
// Hash i = sha256(hash(i - 1) + tag + tokens(i) + tail): the Python loop spent ~0.6 us per
// block on interpreter work around two sha256 compressions (~0.1 us). Here one call reads the
// token ids, runs every block's sha256 and returns the list of digests (2048 blocks of 16
// tokens: ~0.25 ms against ~1.5 ms on a 2.45 GHz EPYC with SHA-NI, ~0.2 ms of it the
// compressions).
//
// sha256 is OpenSSL's libcrypto, the one CPython's _hashlib (hashlib.sha256) already runs:
// its assembly picks SHA-NI / AVX2 / ARMv8 at run time, and nothing here reimplements the
// hash. The message of a block has a fixed length, so its sha256 padding is written once into
// a template and each block is one SHA256_Update over whole 64-byte blocks, after which the
// state words are the digest: no SHA256_Final (with it a prototype of the chain took 40 % longer).
//
// No OpenSSL headers are needed to build this (a machine without libssl-dev builds it): the
// two functions and SHA256_CTX are declared below, with the layout OpenSSL has had since 0.9.8
// (1.1 and 3.x alike; 3.x marks these low-level calls deprecated but exports them, and one
// that did not would fail the import). PyInit checks the result on FIPS 180-2's one- and
// two-block vectors, so a library that disagrees makes the import fail: Python hashes then.
//
// Built by raykv/blocks/hashing.py (plain `c++`, Python's headers, linked against the
// libcrypto _hashlib loaded); no torch, so raykv.blocks stays free of it.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "row_sum.h"

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

// One message layout: parent digest, tag, tokens, tail, then sha256's padding for exactly
// this length. Every block of a layout differs only in the parent and the tokens.
struct Layout {
    uint8_t* buf = nullptr;
    size_t padded = 0;  // whole 64-byte blocks
};

typedef uint32_t u32x4 __attribute__((vector_size(16)));

size_t padded_len(size_t len) { return (len + 1 + 8 + 63) / 64 * 64; }

void init_layout(Layout& m, uint8_t* buf, uint8_t tag, size_t token_bytes, const uint8_t* tail,
                 size_t tail_len) {
    size_t len = kDigest + 1 + token_bytes + tail_len;
    m.buf = buf;
    m.padded = padded_len(len);
    std::memset(buf, 0, m.padded);
    buf[kDigest] = tag;
    std::memcpy(buf + kDigest + 1 + token_bytes, tail, tail_len);
    buf[len] = 0x80;
    uint64_t bits = static_cast<uint64_t>(len) * 8;
    for (int k = 0; k < 8; ++k) buf[m.padded - 1 - k] = static_cast<uint8_t>(bits >> (8 * k));
}

// The rows are little-endian: on such a host (x86, ARM) a token is stored as it is. A
// big-endian host fails to build this, and hashes in Python.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "raykv_block_hash: little-endian only");

inline void store_le32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

inline void store_le64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }

// sha256 of the padded message m (parent already in place) into out[0..32).
inline void digest(const Layout& m, uint8_t* out) {
    raykv_sha256_ctx c;
    SHA256_Init(&c);
    SHA256_Update(&c, m.buf, m.padded);
    // The digest is the state words big-endian. Swapped 16 bytes at a time (SSE2 / NEON via
    // GCC's vector extension) and stored as such: the next block's sha256 loads these bytes
    // 16 at a time right away, and a load cannot be forwarded from several narrower stores
    // (8 word stores cost ~15 % of the chain's time in stalls).
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

// The four message layouts of a call: narrow / wide rows, and the first block's with the salt.
struct Layouts {
    Layout narrow, wide, first_narrow, first_wide;
    bool salted = false;  // block 0 ends in the salt's tail
};

struct Ids {  // where the ids come from: a list / tuple's items, or a uint32 / int64 buffer
    PyObject* const* items = nullptr;
    const uint32_t* ids32 = nullptr;
    const int64_t* ids64 = nullptr;
};

// Block b's tokens written into its layout (chosen by the block's width); the layout, or
// nullptr if an id of a list is not an int64 (ids.items: read only with the GIL). Each source
// has its own tight loop: the fewer instructions per id, the more of them the CPU runs under
// the previous block's sha256 rounds (one long dependency chain that leaves the ALUs idle).
inline Layout* pack_block(Layouts& l, Py_ssize_t b, const Ids& ids, Py_ssize_t bs) {
    bool first = b == 0 && l.salted;
    Layout* m = first ? &l.first_narrow : &l.narrow;
    uint8_t* p = m->buf + kDigest + 1;
    if (ids.ids32 != nullptr) {  // little-endian: the array's bytes are the row's
        std::memcpy(p, ids.ids32 + b * bs, 4 * bs);
        return m;
    }
    // Packed narrow as the ids are read (the usual block), repacked wide if one does not fit:
    // the block is narrow iff every id is in 0 .. 2**32 - 1.
    uint64_t high = 0;
    if (ids.items != nullptr) {
        PyObject* const* items = ids.items + b * bs;
        for (Py_ssize_t j = 0; j < bs; ++j) {
            int64_t v;
            if (!read_id(items[j], &v)) return nullptr;
            high |= static_cast<uint64_t>(v) >> 32;
            store_le32(p + 4 * j, static_cast<uint32_t>(v));
        }
        if (high == 0) return m;
        m = first ? &l.first_wide : &l.wide;
        p = m->buf + kDigest + 1;
        for (Py_ssize_t j = 0; j < bs; ++j) {  // read again: rare, and nothing kept meanwhile
            int64_t v = 0;
            read_id(items[j], &v);  // read fine a moment ago, and no Python code ran since
            store_le64(p + 8 * j, static_cast<uint64_t>(v));
        }
        return m;
    }
    const int64_t* t = ids.ids64 + b * bs;
    for (Py_ssize_t j = 0; j < bs; ++j) {
        high |= static_cast<uint64_t>(t[j]) >> 32;
        store_le32(p + 4 * j, static_cast<uint32_t>(t[j]));
    }
    if (high == 0) return m;
    m = first ? &l.first_wide : &l.wide;
    p = m->buf + kDigest + 1;
    for (Py_ssize_t j = 0; j < bs; ++j) store_le64(p + 8 * j, static_cast<uint64_t>(t[j]));
    return m;
}

// The chain: emit(b, digest) for every block in turn; false if an id of a list is not an
// int64 or emit failed.
template <typename Emit>
inline bool run_chain(Layouts& l, const Ids& ids, Py_ssize_t n, Py_ssize_t bs, uint8_t* prev,
                      Emit emit) {
    for (Py_ssize_t b = 0; b < n; ++b) {
        Layout* m = pack_block(l, b, ids, bs);
        if (m == nullptr) return false;
        std::memcpy(m->buf, prev, kDigest);
        digest(*m, prev);
        if (!emit(b, prev)) return false;
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
    size_t wide_len = padded_len(kDigest + 1 + 8 * bs + tail_len);
    size_t fwide_len = padded_len(kDigest + 1 + 8 * bs + ftail_len);
    uint8_t* msgs = t_msgs.get(2 * wide_len + 2 * fwide_len);  // a narrow one fits a wide's room
    if (msgs == nullptr) return PyErr_NoMemory();
    Layouts l;
    init_layout(l.narrow, msgs, kNarrow, 4 * bs, tail, tail_len);
    init_layout(l.wide, msgs + wide_len, kWide, 8 * bs, tail, tail_len);
    if (ftail != nullptr) {
        l.salted = true;
        init_layout(l.first_narrow, msgs + 2 * wide_len, kNarrow, 4 * bs, ftail, ftail_len);
        init_layout(l.first_wide, msgs + 2 * wide_len + fwide_len, kWide, 8 * bs, ftail, ftail_len);
    }
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
    bool release = static_cast<size_t>(n) * l.narrow.padded >= kReleaseGilBytes;
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
// host's copy threads (raykv.ops_threads) each take a range of rows. ValueError before
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
// vectors, through the same padded-template path as the chain.
bool self_test() {
    static const uint8_t abc[32] = {
        0xba, 0x78, 0x16, 0xbf, 0x8f, 0x01, 0xcf, 0xea, 0x41, 0x41, 0x40, 0xde, 0x5d, 0xae, 0x22,
        0x23, 0xb0, 0x03, 0x61, 0xa3, 0x96, 0x17, 0x7a, 0x9c, 0xb4, 0x10, 0xff, 0x61, 0xf2, 0x00,
        0x15, 0xad};
    static const uint8_t two[32] = {
        0x24, 0x8d, 0x6a, 0x61, 0xd2, 0x06, 0x38, 0xb8, 0xe5, 0xc0, 0x26, 0x93, 0x0c, 0x3e, 0x60,
        0x39, 0xa3, 0x3c, 0xe4, 0x59, 0x64, 0xff, 0x21, 0x67, 0xf6, 0xec, 0xed, 0xd4, 0x19, 0xdb,
        0x06, 0xc1};
    const char* msgs[2] = {"abc", "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"};
    const uint8_t* want[2] = {abc, two};
    for (int i = 0; i < 2; ++i) {
        size_t len = std::strlen(msgs[i]);
        uint8_t buf[128] = {0};
        std::memcpy(buf, msgs[i], len);
        Layout m;
        m.buf = buf;
        m.padded = padded_len(len);
        buf[len] = 0x80;
        for (int k = 0; k < 8; ++k) {
            buf[m.padded - 1 - k] = static_cast<uint8_t>((len * 8) >> (8 * k));
        }
        uint8_t got[kDigest];
        digest(m, got);
        if (std::memcmp(got, want[i], kDigest) != 0) return false;
    }
    return true;
}

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
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "raykv_block_hash", nullptr, -1, methods,
                          nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_raykv_block_hash(void) {
    if (!self_test()) {
        PyErr_SetString(PyExc_ImportError,
                        "raykv_block_hash: libcrypto's SHA256 gave a wrong digest on the FIPS "
                        "180-2 vectors");
        return nullptr;
    }
    return PyModule_Create(&module_def);
}
