// raykv's chained block hashes in one native call (raykv/blocks/hashing.py defines them; this
// file computes the same bytes, it defines nothing), and the host's row sums (row_sum.h defines
// them; raykv.tiers.checksum calls them), which share this build.
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

// One row's sum: its whole words four at a time (four independent multiplies in flight, where
// one accumulator would wait on each add), then the last partial word zero-padded.
uint64_t row_sum(const uint8_t* p, size_t width) {
    const size_t words = width / 8;
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, key = raykv_word_key(0);
    constexpr uint64_t step = RAYKV_ROW_SUM_KEY_MUL;
    size_t j = 0;
    for (; j + 4 <= words; j += 4, key += 4 * step) {
        uint64_t x[4];
        std::memcpy(x, p + 8 * j, sizeof x);
        a0 += raykv_word_mix(x[0], key);
        a1 += raykv_word_mix(x[1], key + step);
        a2 += raykv_word_mix(x[2], key + 2 * step);
        a3 += raykv_word_mix(x[3], key + 3 * step);
    }
    for (; j < words; ++j, key += step) {
        uint64_t x;
        std::memcpy(&x, p + 8 * j, sizeof x);
        a0 += raykv_word_mix(x, key);
    }
    if (width % 8) {
        uint64_t x = 0;  // little-endian host: the row's last bytes are the word's low bytes
        std::memcpy(&x, p + 8 * words, width % 8);
        a0 += raykv_word_mix(x, key);
    }
    return a0 + a1 + a2 + a3;
}

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
