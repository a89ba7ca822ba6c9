"""Block hashes: chained, seeded, stable across processes (invariant 10)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.blocks import BlockHasher
from raykv.errors import InvalidInput

TOKENS = [1, 2, 3, 2**40, -5, 0, 7, 8, 9, 10, 11]

_CHILD = """
from raykv.blocks import BlockHasher
h = BlockHasher(4, seed="cluster-a")
out = h.hash_blocks({tokens!r}, lora_id=3, cache_salt="tenant")
print(",".join(x.hex() for x in out))
"""


def test_hashes_reproduce_in_separate_processes():
    expected = BlockHasher(4, seed="cluster-a").hash_blocks(TOKENS, lora_id=3, cache_salt="tenant")
    outputs = []
    for hash_seed in ("0", "12345"):  # Python's own hash() differs between these two
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        res = subprocess.run(
            [sys.executable, "-c", _CHILD.format(tokens=TOKENS)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        outputs.append(res.stdout.strip())
    assert outputs[0] == outputs[1] == ",".join(x.hex() for x in expected)


def test_only_full_blocks_are_hashed():
    h = BlockHasher(4)
    assert len(h.hash_blocks(TOKENS)) == 2
    assert h.hash_blocks(TOKENS[:3]) == []


@settings(max_examples=50, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31), min_size=0, max_size=40),
    bs=st.integers(1, 5),
    cut=st.integers(0, 10),
)
def test_chain_in_pieces_equals_chain_at_once(tokens, bs, cut):
    h = BlockHasher(bs, seed=7)
    whole = h.hash_blocks(tokens, lora_id=1, cache_salt=b"s")
    cut = min(cut, len(whole))
    head = h.hash_blocks(tokens[: cut * bs], lora_id=1, cache_salt=b"s")
    tail = h.hash_blocks(
        tokens, first_block=cut, parent=head[-1] if head else None, lora_id=1, cache_salt=b"s"
    )
    assert head + tail == whole
    assert h.hash_blocks(np.array(tokens, dtype=np.int64), lora_id=1, cache_salt=b"s") == whole


def test_chain_covers_the_whole_prefix():
    h = BlockHasher(2)
    a = h.hash_blocks([1, 2, 3, 4])
    b = h.hash_blocks([9, 2, 3, 4])
    assert a[1] != b[1]  # same second block, different first block


def test_extra_keys_and_seed_change_every_hash():
    base = BlockHasher(2).hash_blocks(TOKENS)
    variants = [
        BlockHasher(2, seed=1).hash_blocks(TOKENS),
        BlockHasher(2).hash_blocks(TOKENS, lora_id=1),
        BlockHasher(2).hash_blocks(TOKENS, cache_salt="x"),
        BlockHasher(2).hash_blocks(TOKENS, cache_salt=b"x"),
    ]
    for v in variants:
        assert all(x != y for x, y in zip(base, v, strict=True))
    assert variants[2] != variants[3]  # str and bytes salts never collide
    # the salt enters the first block only; later blocks differ through the chain alone
    salted = BlockHasher(2).hash_blocks(TOKENS, first_block=1, parent=base[0], cache_salt="x")
    assert salted == base[1:]


def test_bad_tokens_raise_invalid_input():
    with pytest.raises(InvalidInput):
        BlockHasher(2).hash_blocks([1, 2**70])
    with pytest.raises(InvalidInput):
        BlockHasher(2).hash_blocks([1, 2, 3, 4], first_block=1)
    with pytest.raises(InvalidInput):
        BlockHasher(0)
