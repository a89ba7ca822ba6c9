"""Block hashes: sha256 chained over token ids, reproducible on every process and node.

A hash block holds ``hash_block_size`` tokens. Hash ``i`` covers every token before the end
of hash block ``i``: ``sha256(row(i) + hash(i - 1))``, where hash ``-1`` is the seeded root
and ``row(i)`` is the block's tokens, then the extra keys. The tokens go in as little-endian
uint32 behind the tag 0x05 when every token of the block is in ``0 .. 2**32 - 1`` (any real
vocabulary), else as little-endian int64 behind the tag 0x06: one injective encoding per
block that keeps a 16-token row (67 bytes, 99 with the parent) in two sha256 compressions
instead of three. The extra keys are two bytes, ``0x00 0x00``, in every block but a
tenant's first: a request's tenant (``tenant_key``: its cache salt and LoRA adapter as one
32-byte digest) replaces the second byte there with its encoding, and the chain carries it
on, so no block of a tenant's prompt shares a hash with the same tokens under another
tenant or none, and a prompt without a tenant hashes as it always did. The parent comes
last, a fixed 32 bytes at the end of the message: a row's whole 64-byte chunks are its
block's own, so their sha256 state (the midstate) needs no parent, and only a block's last
compression waits for the block before (with the parent first, v2, both of a 16-token
block's did). Nothing here uses Python's
``hash()`` (randomized per process); the seed is explicit (invariant 10) and
``HASH_VERSION`` names this definition: it is the one implementation, used by the block
manager's prefix cache, the service's group keys, the CPU tier's keys and the client's
lookups alike.

Speed: ``hash_blocks`` runs the whole chain in one native call (``kernels/block_hash.cpp``;
the ids read from the list as it goes, or without the GIL from a uint32 / int64 array). On
x86 with the SHA extensions each block's last compression runs in lockstep with the next
block's midstate, so a block costs about one compression's latency; elsewhere OpenSSL's
sha256 (the libcrypto hashlib runs) hashes block after block. 2048 blocks of 16 tokens from a
list: ~0.13 ms as one joined bytes object (a lookup's form; ~0.165 ms as a list of bytes,
~0.10 ms joined from a uint32 array) where v2's chain took ~0.22 ms and the Python loop takes
~1.35 ms (2-core 2.45 GHz EPYC, Zen 3, with SHA-NI; the min of 1000 runs). The extension is
compiled on first use with the machine's C++ compiler into ``$RAYKV_CACHE_DIR`` (default
``~/.cache/raykv``, ~2 s once per machine and Python build) in a background thread, so no
call waits for a compiler: until it is loaded, and wherever it cannot be built
(``native_status()`` says why, and a warning once per process), the Python path below
computes the same bytes; it stays the reference the tests hold the native chain to.
``build_native()`` builds it ahead (a service's startup, a benchmark);
``RAYKV_DISABLE_NATIVE_HASH=1`` keeps the Python path. The Python path: the tokens become
one array at once (one ``array("I")`` pass for a list of ids that fit uint32, the usual
prompt, else ``array("Q")``; no copy for an integer numpy array), every row is built by numpy
in one pass, and the loop does one ``sha256(...).digest()`` per block with no per-token
Python work.

A group whose block size is ``k x hash_block_size`` names its block ``j`` by hash
``(j + 1) * k - 1``, the chained hash at the end of that block. The pool keys its map by
``(group_id, hash)`` so two groups never share an entry.
"""

from __future__ import annotations

import array
import hashlib
import logging
import os
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from raykv.errors import InvalidInput

log = logging.getLogger(__name__)

HASH_VERSION = b"raykv/block-hash/v3"
DEFAULT_HASH_SEED = 0
DIGEST_BYTES = 32  # sha256: every BlockHash is this long

BlockHash = bytes
Tenant = bytes | None  # ``tenant_key``'s digest; None: no tenant

_NARROW, _WIDE = 0x05, 0x06  # row tags: uint32 tokens / int64 tokens
_NO_TENANT = b"\x00\x00"  # every row's extra keys but a tenant's first (module docstring)
_U32 = 1 << 32
_FEW = 8  # up to this many blocks, rows are packed without numpy (cheaper per call)
_U32_CODE = next((c for c in "IL" if array.array(c).itemsize == 4), None)  # array's uint32


def _encode(value: int | str | bytes | None) -> bytes:
    """Type-tagged, length-prefixed encoding: distinct values never serialize alike."""
    if value is None:
        return b"\x00"
    if isinstance(value, bool):  # bool is an int: keep True apart from 1
        return b"\x04" + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
        return b"\x01" + struct.pack("<I", len(raw)) + raw
    if isinstance(value, str):
        value = value.encode("utf-8")
        tag = b"\x02"
    else:
        value = bytes(value)
        tag = b"\x03"
    return tag + struct.pack("<I", len(value)) + value


TENANT_VERSION = b"raykv/tenant/v1"
TENANT_LABEL_CHARS = 8  # a tenant's metrics label: this many hex digits of its key


def tenant_key(
    cache_salt: str | bytes | None = None,
    lora: str | int | None = None,
    lora_path: str | None = None,
) -> Tenant:
    """The one key a request's tenant hashes under: its cache salt (vLLM's ``cache_salt``)
    and its LoRA adapter, as one sha256 digest; None for none of them, so a request without
    a tenant hashes as before. The adapter is its name (``lora``; not vLLM's int id, which a
    server numbers as adapters load, so one id names different adapters on different
    engines) and, as vLLM keys it, the path it was loaded from (``lora_path``: a name pointed
    at another adapter does not reuse the old one's KV). A digest, not the raw salt: a fixed
    32 bytes in every message and row that carries it, and a salt never appears in metadata
    or metrics (``tenant_label``)."""
    if cache_salt is None and lora is None and lora_path is None:
        return None
    keys = _encode(cache_salt) + _encode(lora) + _encode(lora_path)
    return hashlib.sha256(TENANT_VERSION + keys).digest()


def tenant_label(tenant: Tenant) -> str:
    """A tenant's metrics label: "none", or the first hex digits of its key (a tenant's
    salt cannot be read back from it; ``ServiceMetrics`` bounds how many labels it keeps)."""
    return "none" if tenant is None else tenant.hex()[:TENANT_LABEL_CHARS]


def narrow_array(token_ids: Any, start: int = 0, stop: int | None = None) -> np.ndarray | None:
    """``token_ids[start:stop]`` as one uint32 array when every id is an integer in
    ``0 .. 2**32 - 1`` (any real vocabulary), else None: a list in one C pass
    (``array("I")``, which refuses a float, a negative or a wider id), a uint32 numpy array
    as it is. Its rows need no range check and no conversion (``_rows``)."""
    if isinstance(token_ids, np.ndarray):
        return token_ids.reshape(-1)[start:stop] if token_ids.dtype == np.uint32 else None
    if _U32_CODE is None:
        return None
    whole = start == 0 and (stop is None or stop >= len(token_ids))
    try:
        return np.frombuffer(
            array.array(_U32_CODE, token_ids if whole else token_ids[start:stop]), np.uint32
        )
    except (TypeError, OverflowError):
        return None


def token_array(token_ids: Any, start: int = 0, stop: int | None = None) -> np.ndarray:
    """``token_ids[start:stop]`` as one int64 array: an integer numpy array is used as it is
    (no per-token work), anything else is converted in one C pass (``array("Q")``, then
    ``struct`` where an id is negative). InvalidInput for a non-integer or a value outside
    int64."""
    if isinstance(token_ids, np.ndarray) and token_ids.dtype.kind in "iu":
        a = token_ids.reshape(-1)[start:stop]
    else:
        whole = start == 0 and (stop is None or stop >= len(token_ids))
        seq = token_ids if whole else token_ids[start:stop]  # (a copy costs a third more)
        try:
            a = np.frombuffer(array.array("Q", seq), np.uint64)  # ids >= 0: the usual prompt
        except (TypeError, OverflowError):  # a negative id (or a bad one: struct names it)
            try:
                return np.frombuffer(struct.pack(f"<{len(seq)}q", *seq), "<i8")
            except struct.error as e:
                raise InvalidInput(
                    f"token ids must be integers in the int64 range ({e}); nothing was hashed"
                ) from None
    if a.dtype.kind == "u" and a.dtype.itemsize == 8 and a.size and int(a.max()) >= 1 << 63:
        raise InvalidInput(
            f"token ids must be integers in the int64 range, got {int(a.max())}; nothing was hashed"
        )
    return a.view("<i8") if a.dtype == "<u8" else a.astype("<i8", copy=False)


def _rows(blocks: np.ndarray, tail: bytes) -> list[bytes]:
    """One ``tag + tokens + tail`` row per block (``blocks``: [n, hash_block_size] int64, or
    uint32 from ``narrow_array``)."""
    n = blocks.shape[0]
    if n == 0:
        return []
    narrow = blocks.dtype == np.uint32  # from ``narrow_array``: every id fits, no check
    if narrow or (int(blocks.min()) >= 0 and int(blocks.max()) < _U32):  # every block is narrow
        body = blocks.astype("<u4", copy=False)
        w = body.shape[1] * 4
        buf = np.empty((n, 1 + w + len(tail)), np.uint8)
        buf[:, 0] = _NARROW
        buf[:, 1 : 1 + w] = body.view(np.uint8).reshape(n, w)
        buf[:, 1 + w :] = np.frombuffer(tail, np.uint8)
        return buf.view(f"V{buf.shape[1]}").ravel().tolist()  # bytes, no byte dropped
    narrow = (blocks >= 0).all(axis=1) & (blocks < _U32).all(axis=1)
    return [
        (bytes([_NARROW]) + b.astype("<u4").tobytes() if ok else bytes([_WIDE]) + b.tobytes())
        + tail
        for b, ok in zip(blocks, narrow.tolist(), strict=True)
    ]


# The native chain (kernels/block_hash.cpp), compiled once per machine and Python build.
_NATIVE = "raykv_block_hash"  # the extension's module name (its PyInit_ symbol)
_NATIVE_SOURCE = "block_hash.cpp"
_NATIVE_HEADER = "row_sum.h"
_NATIVE_OFF = "RAYKV_DISABLE_NATIVE_HASH"
_native_lock = threading.Lock()
_chain: Callable[..., list[bytes] | bytes | None] | None = None  # the loaded ``chain``
_module: ModuleType | None = None  # the loaded extension (``raykv.tiers.checksum``: row sums)
_native_state: str | None = None  # why the native chain is (not) in use, once decided
_native_thread: threading.Thread | None = None


def native_status() -> str:
    """One line: whether ``hash_blocks`` runs the native chain or the Python path, and why."""
    return _native_state or "Python path: the native chain is not decided yet (build_native())"


def native_module() -> ModuleType | None:
    """The loaded extension (``chain`` and ``row_sums``), or None while it is not decided
    (the first call starts its build in the background) or where it cannot load."""
    if _native_state is None:
        _start_native()
    return _module


def build_native(wait: bool = True) -> str:
    """Compile (or find compiled) and load the native chain, in a background thread; with
    ``wait`` block until it is decided. ``native_status()``'s line. ``hash_blocks`` starts
    this itself on first use and hashes in Python until it is done."""
    thread = _start_native()
    if wait and thread is not None:
        thread.join()
    return native_status()


def _start_native() -> threading.Thread | None:
    global _native_thread
    with _native_lock:
        if _native_state is None and _native_thread is None:
            _native_thread = threading.Thread(
                target=_decide_native, name="raykv-hash-build", daemon=True
            )
            _native_thread.start()
        return _native_thread


def _decide_native() -> None:
    global _chain, _module, _native_state
    try:
        module, state, fix = _load_native()
    except Exception as e:  # never let the fast path's setup fail a caller: hash in Python
        module, state = None, f"Python path: loading the native chain failed: {e!r}"
        fix = f"delete the build under {os.environ.get('RAYKV_CACHE_DIR', '~/.cache/raykv')}"
    if fix:  # the fast path is missing where it was not turned off: say so once per process
        log.warning(
            "raykv block hashing runs in Python, ~10x slower than native (%s). Fix: %s; or "
            "set %s=1 to use the Python path on purpose.",
            state.removeprefix("Python path: "),
            fix,
            _NATIVE_OFF,
        )
    else:
        log.debug("raykv block hashing: %s", state)
    with _native_lock:
        _chain = module.chain if module is not None else None
        _module, _native_state = module, state


def _reset_native_in_child() -> None:
    # a fork while the build thread runs: the child has no such thread, so it decides anew
    # (the parent's build is usually in the cache by then); the lock may have been held
    global _native_lock, _native_thread
    _native_lock = threading.Lock()
    if _native_state is None:
        _native_thread = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_native_in_child)


# The build's own imports (importlib.resources, subprocess, ...; ~25 ms) are made by the
# build thread, not by every process that imports raykv.blocks.


def _native_source() -> Path | None:
    """kernels/block_hash.cpp: ``$RAYKV_KERNELS_DIR`` when set, else the wheel's copy
    (``raykv/_kernels``), else the source checkout's (as raykv.ops.kernel finds the CUDA
    kernel's sources, without importing torch)."""
    import importlib.resources

    override = os.environ.get("RAYKV_KERNELS_DIR", "")
    dirs = [Path(override)] if override else []
    dirs += [Path(str(importlib.resources.files("raykv") / "_kernels"))]
    dirs += [Path(__file__).resolve().parents[2] / "kernels"]
    return next((d / _NATIVE_SOURCE for d in dirs if (d / _NATIVE_SOURCE).is_file()), None)


def _libcrypto() -> list[str] | None:
    """Linker arguments for the libcrypto hashlib itself runs (read from this process's
    mappings once ``_hashlib`` is loaded): the very library, no OpenSSL headers or -dev
    package needed. Else the one the system's loader finds; None if there is none."""
    try:
        import _hashlib  # noqa: F401  (loads libcrypto where Python links it dynamically)

        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                path = parts[5].strip() if len(parts) == 6 else ""
                # (a library replaced on disk since it was loaded reads "... (deleted)")
                if os.path.basename(path).startswith("libcrypto.so") and os.path.isfile(path):
                    return [path, f"-Wl,-rpath,{os.path.dirname(path)}"]
    except (ImportError, OSError):
        pass
    import ctypes.util

    name = ctypes.util.find_library("crypto")
    if not name:
        return None
    return [name] if os.path.isabs(name) else [f"-l:{name}"]


def _load_native() -> tuple[ModuleType | None, str, str]:
    """(module, status, fix): the built extension, compiled now if the cache has
    none for this source, Python build and libcrypto; else None, the reason and the fix
    (empty where the Python path was asked for)."""
    import importlib.machinery
    import importlib.util
    import shutil
    import sysconfig

    if os.environ.get(_NATIVE_OFF, "") not in ("", "0"):
        return None, f"Python path: {_NATIVE_OFF} is set", ""
    source = _native_source()
    if source is None:
        return (
            None,
            f"Python path: {_NATIVE_SOURCE} not found",
            "reinstall raykv from a wheel that ships raykv/_kernels, or point RAYKV_KERNELS_DIR "
            "at the kernels/ folder of a raykv checkout",
        )
    crypto = _libcrypto()
    if crypto is None:
        return None, "Python path: no libcrypto to link to", "install OpenSSL (libcrypto)"
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    # one build per source, Python build (ABI) and libcrypto; whichever compiler made it
    header = source.with_name(_NATIVE_HEADER)  # row_sum.h, which the source includes
    texts = (source.read_text(), header.read_text() if header.is_file() else "")
    digest = hashlib.sha256("\0".join((*texts, sys.version, suffix, *crypto)).encode())
    key = digest.hexdigest()[:16]
    cache = Path(os.environ.get("RAYKV_CACHE_DIR", Path.home() / ".cache" / "raykv"))
    built = cache / "block_hash" / key / f"{_NATIVE}{suffix}"
    if not built.is_file():
        cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        include = sysconfig.get_paths()["include"]
        if cxx is None:
            return None, "Python path: no C++ compiler to build it", "install g++ (or set CXX)"
        if not (Path(include) / "Python.h").is_file():
            return (
                None,
                f"Python path: no Python.h in {include}",
                "install Python's development headers (python3-dev)",
            )
        error = _compile(cxx, source, include, crypto, built)
        if error:
            return (
                None,
                f"Python path: building {source} failed: {error}",
                "see the compiler's output above",
            )
    spec = importlib.util.spec_from_file_location(_NATIVE, built)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # runs the library's sha256 self-test (ImportError)
    return module, f"native chain {_NATIVE} ({built})", ""


def _compile(cxx: str, source: Path, include: str, crypto: list[str], out: Path) -> str:
    """Build the extension into ``out`` (atomically: processes building at once each write
    their own file and rename it); the compiler's complaint, or '' when built."""
    import subprocess

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    cmd = [cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden"]
    if sys.platform == "darwin":  # Python's symbols resolve when the interpreter loads it
        cmd += ["-undefined", "dynamic_lookup"]
    cmd += ["-I", include, str(source), "-o", str(tmp), *crypto]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        tmp.unlink(missing_ok=True)
        return repr(e)
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        return f"{' '.join(cmd)}: {res.stderr.strip()[-2000:]}"
    os.replace(tmp, out)
    return ""


class BlockHasher:
    """Chained block hashes for one ``hash_block_size`` and one seed."""

    def __init__(self, hash_block_size: int, seed: int | str | bytes = DEFAULT_HASH_SEED):
        if hash_block_size < 1:
            raise InvalidInput(f"hash_block_size must be >= 1, got {hash_block_size}")
        self.hash_block_size = hash_block_size
        self.seed = seed
        self.root: BlockHash = hashlib.sha256(
            HASH_VERSION + _encode(hash_block_size) + _encode(seed)
        ).digest()
        # a few blocks (a decode step filling one) skip numpy's per-call cost: same rows
        self._narrow = struct.Struct(f"<B{hash_block_size}I").pack
        self._wide = struct.Struct(f"<B{hash_block_size}q").pack

    def __reduce__(self):
        # the precompiled struct layouts do not pickle; a copy rebuilds them from the args
        return (BlockHasher, (self.hash_block_size, self.seed))

    def _few_rows(self, token_ids: Sequence[int], first: int, last: int, tail: bytes) -> list:
        """``_rows`` for a few blocks of a sequence, without numpy: a token outside uint32
        makes the narrow pack fail, and the block goes wide."""
        bs, out, narrow, wide = self.hash_block_size, [], self._narrow, self._wide
        for i in range(first, last):
            block = token_ids[i * bs : (i + 1) * bs]
            try:
                out.append(narrow(_NARROW, *block) + tail)
            except struct.error:
                try:
                    out.append(wide(_WIDE, *block) + tail)
                except struct.error as e:
                    raise InvalidInput(
                        f"token ids must be integers in the int64 range ({e}); nothing was hashed"
                    ) from None
        return out

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        *,
        first_block: int = 0,
        end_block: int | None = None,
        parent: BlockHash | None = None,
        tenant: Tenant = None,
    ) -> list[BlockHash]:
        """Hashes of the full hash blocks ``first_block .. end_block - 1`` of ``token_ids``
        (the whole sequence: a list, tuple or integer numpy array; by default up to its last
        full block, a partial one is never hashed).

        ``parent`` is the hash of block ``first_block - 1``; it is required when
        ``first_block > 0`` so the chain stays one chain however it is computed in pieces
        (the ``tenant`` then enters nothing: it is in the parent already).
        ``tenant``: the request's ``tenant_key``, which enters block 0. One native call
        where the extension is loaded, else the Python loop below (module docstring); the
        same bytes either way.
        """
        return self._hash(token_ids, first_block, end_block, parent, tenant)

    def hash_blocks_joined(
        self, token_ids: Sequence[int], *, end_block: int | None = None, tenant: Tenant = None
    ) -> bytes:
        """``b"".join(hash_blocks(token_ids, end_block=end_block, tenant=tenant))`` made as
        one bytes object natively (a lookup's form: no object per block, no join)."""
        return self._hash(token_ids, 0, end_block, None, tenant, joined=True)

    def _hash(
        self,
        token_ids: Sequence[int],
        first_block: int,
        end_block: int | None,
        parent: BlockHash | None,
        tenant: Tenant,
        joined: bool = False,
    ) -> Any:
        if first_block > 0 and parent is None:
            raise InvalidInput(f"hashing from block {first_block} needs the parent hash")
        bs = self.hash_block_size
        last = len(token_ids) // bs if end_block is None else min(end_block, len(token_ids) // bs)
        if last <= first_block:
            return b"" if joined else []
        if tenant is not None and not isinstance(tenant, bytes):
            raise InvalidInput(
                f"a tenant is tenant_key(cache_salt, lora)'s bytes, got {type(tenant).__name__}; "
                "nothing was hashed"
            )
        tail = _NO_TENANT
        # a tenant enters the first block: its row ends in the tenant instead of the last 0
        first_tail = b"\x00" + _encode(tenant) if first_block == 0 and tenant is not None else None
        prev = self.root if first_block == 0 else parent
        chain = _chain
        if chain is None and _native_state is None:
            # the first call of a process starts the build (or the cached build's load) in the
            # background and hashes in Python meanwhile: no request waits for a compiler
            _start_native()
        elif chain is not None:
            hashes = self._native(
                chain, token_ids, first_block, last, prev, tail, first_tail, joined
            )
            if hashes is not None:
                return hashes
        if last - first_block <= _FEW and not isinstance(token_ids, np.ndarray):
            rows = self._few_rows(token_ids, first_block, last, tail)
        else:
            tokens = narrow_array(token_ids, first_block * bs, last * bs)
            if tokens is None:
                tokens = token_array(token_ids, first_block * bs, last * bs)
            rows = _rows(tokens.reshape(last - first_block, bs), tail)
        if first_tail is not None:
            rows[0] = rows[0][: -len(tail)] + first_tail
        sha = hashlib.sha256
        hashes = [prev := sha(row + prev).digest() for row in rows]
        return b"".join(hashes) if joined else hashes

    def _native(
        self,
        chain: Callable[..., list[bytes] | bytes | None],
        token_ids: Any,
        first_block: int,
        last: int,
        parent: BlockHash,
        tail: bytes,
        first_tail: bytes | None,
        joined: bool = False,
    ) -> list[BlockHash] | bytes | None:
        """``hash_blocks`` in one native call; None where the Python path must decide (a
        token id that is not an int in the int64 range: it raises InvalidInput or hashes)."""
        bs, n = self.hash_block_size, last - first_block
        start, stop = first_block * bs, last * bs
        if isinstance(token_ids, np.ndarray):  # uint32 or int64, checked, contiguous
            tokens = narrow_array(token_ids, start, stop)
            if tokens is None:
                tokens = token_array(token_ids, start, stop)
            tokens, start = np.ascontiguousarray(tokens), 0
        elif isinstance(token_ids, (list, tuple)):
            tokens = token_ids  # read in place from ``start``
        else:  # another sequence: one pass into a list
            whole = start == 0 and stop >= len(token_ids)
            tokens, start = list(token_ids if whole else token_ids[start:stop]), 0
        return chain(tokens, start, n, bs, parent, tail, first_tail, joined)


def split_hashes(blob: bytes, every: int = 1) -> list[BlockHash]:
    """Hashes ``every - 1, 2 * every - 1, ...`` of a chain sent as one blob
    (``b"".join(hashes)``): one bytes object on the wire instead of one per block, cut
    without per-hash Python work. InvalidInput if ``blob`` is not whole hashes."""
    if len(blob) % DIGEST_BYTES or every < 1:
        raise InvalidInput(
            f"a hash blob holds whole {DIGEST_BYTES}-byte hashes (got {len(blob)} bytes, "
            f"every={every}); send b''.join(BlockHasher.hash_blocks(...))"
        )
    return np.frombuffer(blob, f"V{DIGEST_BYTES}")[every - 1 :: every].tolist()
