"""Block hashes: sha256 chained over token ids, reproducible on every process and node.

A hash block holds ``hash_block_size`` tokens. Hash ``i`` covers every token before the end
of hash block ``i``: ``sha256(hash(i - 1) + row(i))``, where hash ``-1`` is the seeded root
and ``row(i)`` is the block's tokens, then the extra keys. The tokens go in as little-endian
uint32 behind the tag 0x05 when every token of the block is in ``0 .. 2**32 - 1`` (any real
vocabulary), else as little-endian int64 behind the tag 0x06: one injective encoding per
block that keeps a 16-token row in two sha256 compressions (with the 32-byte parent)
instead of three. The LoRA id goes into every block, the cache salt only into the first one
(the chain carries it on). Nothing here uses Python's ``hash()`` (randomized per process);
the seed is explicit (invariant 10) and ``HASH_VERSION`` names this definition: it is the
one implementation, used by the block manager's prefix cache, the service's group keys, the
CPU tier's keys and the client's lookups alike.

Speed: the tokens become one array at once (one ``array("I")`` pass for a list of ids that
fit uint32, the usual prompt, else ``array("Q")``; no copy for an integer numpy array), every
row is built by numpy in one pass, and the loop does one ``sha256(...).digest()`` per block
with no per-token Python work.

A group whose block size is ``k x hash_block_size`` names its block ``j`` by hash
``(j + 1) * k - 1``, the chained hash at the end of that block. The pool keys its map by
``(group_id, hash)`` so two groups never share an entry.
"""

from __future__ import annotations

import array
import hashlib
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from raykv.errors import InvalidInput

HASH_VERSION = b"raykv/block-hash/v2"
DEFAULT_HASH_SEED = 0
DIGEST_BYTES = 32  # sha256: every BlockHash is this long

BlockHash = bytes

_NARROW, _WIDE = 0x05, 0x06  # row tags: uint32 tokens / int64 tokens
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
        lora_id: int | None = None,
        cache_salt: str | bytes | None = None,
    ) -> list[BlockHash]:
        """Hashes of the full hash blocks ``first_block .. end_block - 1`` of ``token_ids``
        (the whole sequence: a list, tuple or integer numpy array; by default up to its last
        full block, a partial one is never hashed).

        ``parent`` is the hash of block ``first_block - 1``; it is required when
        ``first_block > 0`` so the chain stays one chain however it is computed in pieces.
        """
        if first_block > 0 and parent is None:
            raise InvalidInput(f"hashing from block {first_block} needs the parent hash")
        bs = self.hash_block_size
        last = len(token_ids) // bs if end_block is None else min(end_block, len(token_ids) // bs)
        if last <= first_block:
            return []
        tail = b"\x00\x00" if lora_id is None else _encode(lora_id) + b"\x00"
        if last - first_block <= _FEW and not isinstance(token_ids, np.ndarray):
            rows = self._few_rows(token_ids, first_block, last, tail)
        else:
            tokens = narrow_array(token_ids, first_block * bs, last * bs)
            if tokens is None:
                tokens = token_array(token_ids, first_block * bs, last * bs)
            rows = _rows(tokens.reshape(last - first_block, bs), tail)
        if first_block == 0 and cache_salt is not None:  # the salt enters the first block
            rows[0] = rows[0][:-1] + _encode(cache_salt)
        prev, sha = self.root if first_block == 0 else parent, hashlib.sha256
        return [prev := sha(prev + row).digest() for row in rows]


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
