"""Block hashes: sha256 chained over token ids, reproducible on every process and node.

A hash block holds ``hash_block_size`` tokens. Hash ``i`` covers every token before the end
of hash block ``i``: it digests the hash of block ``i - 1`` (or the seeded root), then the
block's tokens as little-endian int64, then the extra keys. The LoRA id goes into every
block, the cache salt only into the first one (the chain carries it on). Nothing here uses
Python's ``hash()`` (randomized per process); the seed is explicit (invariant 10).

A group whose block size is ``k x hash_block_size`` names its block ``j`` by hash
``(j + 1) * k - 1``, the chained hash at the end of that block. The pool keys its map by
``(group_id, hash)`` so two groups never share an entry.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from raykv.errors import InvalidInput

HASH_VERSION = b"raykv/block-hash/v1"
DEFAULT_HASH_SEED = 0

BlockHash = bytes


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
        # Every block has exactly hash_block_size tokens: one precompiled layout.
        self._tokens = struct.Struct(f"<{hash_block_size}q")

    def __reduce__(self):
        # the precompiled struct layout does not pickle; a copy rebuilds it from the args
        return (BlockHasher, (self.hash_block_size, self.seed))

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
        (the whole sequence; by default up to its last full block, a partial one is never
        hashed).

        ``parent`` is the hash of block ``first_block - 1``; it is required when
        ``first_block > 0`` so the chain stays one chain however it is computed in pieces.
        """
        if first_block > 0 and parent is None:
            raise InvalidInput(f"hashing from block {first_block} needs the parent hash")
        bs = self.hash_block_size
        lora = _encode(lora_id)
        salt = _encode(cache_salt)
        prev = self.root if first_block == 0 else parent
        out: list[BlockHash] = []
        pack = self._tokens.pack
        sha = hashlib.sha256
        try:
            last = (
                len(token_ids) // bs if end_block is None else min(end_block, len(token_ids) // bs)
            )
            for i in range(first_block, last):
                tokens = pack(*token_ids[i * bs : (i + 1) * bs])
                prev = sha(prev + tokens + lora + (salt if i == 0 else b"\x00")).digest()
                out.append(prev)
        except struct.error as e:
            raise InvalidInput(
                f"token ids must be integers in the int64 range ({e}); nothing was hashed"
            ) from None
        return out
