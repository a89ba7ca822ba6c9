"""Block hashes: chained, seeded, stable across processes (invariant 10)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.blocks import BlockHasher, hashing
from raykv.blocks.hashing import DIGEST_BYTES, HASH_VERSION, split_hashes, tenant_key
from raykv.errors import InvalidInput
from tests.blocks.helpers import examples

TOKENS = [1, 2, 3, 2**40, -5, 0, 7, 8, 9, 10, 11]
TENANT = tenant_key("tenant", "adapter")

_CHILD = """
from raykv.blocks import BlockHasher, tenant_key
h = BlockHasher(4, seed="cluster-a")
out = h.hash_blocks({tokens!r}, tenant=tenant_key("tenant", "adapter"))
print(",".join(x.hex() for x in out))
"""


def test_hashes_reproduce_in_separate_processes():
    expected = BlockHasher(4, seed="cluster-a").hash_blocks(TOKENS, tenant=TENANT)
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
    whole = h.hash_blocks(tokens, tenant=TENANT)
    cut = min(cut, len(whole))
    head = h.hash_blocks(tokens[: cut * bs], tenant=TENANT)
    tail = h.hash_blocks(tokens, first_block=cut, parent=head[-1] if head else None, tenant=TENANT)
    assert head + tail == whole
    assert h.hash_blocks(np.array(tokens, dtype=np.int64), tenant=TENANT) == whole


def test_chain_covers_the_whole_prefix():
    h = BlockHasher(2)
    a = h.hash_blocks([1, 2, 3, 4])
    b = h.hash_blocks([9, 2, 3, 4])
    assert a[1] != b[1]  # same second block, different first block


def test_tenants_and_seed_change_every_hash():
    base = BlockHasher(2).hash_blocks(TOKENS)
    tenants = [tenant_key(lora="a"), tenant_key("a"), tenant_key(b"a"), tenant_key("a", "a")]
    tenants += [tenant_key(lora=1), tenant_key(lora="1"), tenant_key(""), tenant_key(lora="")]
    tenants += [tenant_key(lora_path="a"), tenant_key(None, "a", "a"), tenant_key(None, "a", "b")]
    assert len(set(tenants)) == len(tenants) and tenant_key() is None
    variants = [BlockHasher(2, seed=1).hash_blocks(TOKENS)]
    variants += [BlockHasher(2).hash_blocks(TOKENS, tenant=t) for t in tenants]
    for i, v in enumerate(variants):
        assert all(x != y for x, y in zip(base, v, strict=True))
        assert all(x != y for w in variants[i + 1 :] for x, y in zip(v, w, strict=True))
    # the tenant enters the first block only; later blocks differ through the chain alone
    salted = BlockHasher(2).hash_blocks(TOKENS, first_block=1, parent=base[0], tenant=TENANT)
    assert salted == base[1:]
    with pytest.raises(InvalidInput, match="tenant_key"):
        BlockHasher(2).hash_blocks(TOKENS, tenant="a raw salt")


_SALT = st.one_of(st.none(), st.text(max_size=6), st.binary(max_size=6))
_LORA = st.one_of(st.none(), st.text(max_size=6), st.integers(0, 2**40))
_PATH = st.one_of(st.none(), st.text(max_size=6))


@settings(max_examples=examples(150, 5_000), deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=80),
    other=st.one_of(st.none(), st.lists(st.integers(0, 2**32 - 1), max_size=80)),
    bs=st.integers(1, 8),
    a=st.tuples(_SALT, _LORA, _PATH),
    b=st.tuples(_SALT, _LORA, _PATH),
)
def test_two_tenants_never_share_a_block_key_and_one_tenant_always_does(tokens, other, bs, a, b):
    """Whatever two prompts (the same one, or one extending the other) and two tenants (a
    cache salt, a LoRA adapter's name and path: any of them, or none), no block of one
    tenant's chain has the hash (and so the key: a group id + the hash) of a block of the
    other's; the same tenant's same tokens are the same keys, whole or as a lookup's blob."""
    from raykv.service.control.index import group_key

    h = BlockHasher(bs)
    second = tokens if other is None else tokens + other
    ta, tb = tenant_key(*a), tenant_key(*b)
    mine, theirs = h.hash_blocks(tokens, tenant=ta), h.hash_blocks(second, tenant=tb)
    if a != b:
        assert ta != tb
        assert not set(mine) & set(theirs)
        assert not {group_key(1, x) for x in mine} & {group_key(1, x) for x in theirs}
    else:  # one tenant: a prompt's keys are the prefix of its extension's
        assert theirs[: len(mine)] == mine
    assert h.hash_blocks(tokens, tenant=tenant_key(*a)) == mine  # the same key every time
    assert h.hash_blocks_joined(tokens, tenant=ta) == b"".join(mine)


def test_bad_tokens_raise_invalid_input():
    with pytest.raises(InvalidInput):
        BlockHasher(2).hash_blocks([1, 2**70])
    with pytest.raises(InvalidInput):
        BlockHasher(2).hash_blocks([1, 2, 3, 4], first_block=1)
    with pytest.raises(InvalidInput):
        BlockHasher(0)


_CHILD_JSON = """
import json, sys
from raykv.blocks import BlockHasher, tenant_key
case = json.loads(sys.stdin.read())
out = []
for tokens, bs, seed, lora, salt in case:
    h = BlockHasher(bs, seed=seed)
    out.append([x.hex() for x in h.hash_blocks(tokens, tenant=tenant_key(salt, lora))])
print(json.dumps(out))
"""

_TOKENS = st.lists(
    st.one_of(st.integers(0, 2**32 - 1), st.integers(-(2**63), 2**63 - 1)), max_size=24
)


@settings(max_examples=3, deadline=None)
@given(
    cases=st.lists(
        st.tuples(
            _TOKENS,
            st.integers(1, 5),
            st.one_of(st.integers(-5, 5), st.text(max_size=4)),
            st.one_of(st.none(), st.integers(0, 9)),
            st.one_of(st.none(), st.text(max_size=4)),
        ),
        min_size=1,
        max_size=8,
    ),
    hash_seed=st.integers(1, 2**31),
)
def test_same_tokens_same_hashes_in_a_process_with_another_hash_seed(cases, hash_seed):
    """Invariant 10, as a property: whatever the tokens, seed and tenant, a process with
    another PYTHONHASHSEED computes the same hashes (one subprocess per example)."""
    import json

    expected = [
        [x.hex() for x in BlockHasher(bs, seed=seed).hash_blocks(t, tenant=tenant_key(sa, lo))]
        for t, bs, seed, lo, sa in cases
    ]
    res = subprocess.run(
        [sys.executable, "-c", _CHILD_JSON],
        input=json.dumps(cases),
        env={**os.environ, "PYTHONHASHSEED": str(hash_seed)},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert json.loads(res.stdout) == expected


@settings(max_examples=60, deadline=None)
@given(tokens=_TOKENS, bs=st.integers(1, 4), tenant=st.one_of(st.none(), st.binary(max_size=3)))
def test_lists_tuples_and_arrays_hash_alike(tokens, bs, tenant):
    h = BlockHasher(bs, seed=3)
    want = h.hash_blocks(tokens, tenant=tenant)
    assert h.hash_blocks(tuple(tokens), tenant=tenant) == want
    assert h.hash_blocks(np.array(tokens, dtype=np.int64), tenant=tenant) == want
    if all(0 <= t < 2**32 for t in tokens):
        assert h.hash_blocks(np.array(tokens, dtype=np.uint32), tenant=tenant) == want
    assert all(len(x) == DIGEST_BYTES for x in want)
    # one block at a time (the few-blocks path) chains to the same hashes as all at once
    one_by_one: list[bytes] = []
    for i in range(len(want)):
        parent = one_by_one[-1] if one_by_one else None
        one_by_one += h.hash_blocks(
            tokens, first_block=i, end_block=i + 1, parent=parent, tenant=tenant
        )
    assert one_by_one == want


def test_wide_and_narrow_tokens_never_hash_alike():
    """A block whose tokens fit uint32 is encoded in 4 bytes each, any other in 8: the tag
    keeps the two apart, and a block's encoding depends on its own tokens only."""
    h = BlockHasher(2)
    # 2**32 + 1 as int64 little endian is the bytes of the two uint32 tokens (1, 1)
    assert h.hash_blocks([1, 1]) != h.hash_blocks([2**32 + 1, 0])[:1]
    assert h.hash_blocks([-1, 0]) != h.hash_blocks([2**32 - 1, 0])
    narrow, wide = [5, 6], [2**40, 7]
    # the first block hashes the same whatever follows it (wide or narrow)
    assert h.hash_blocks(narrow + wide)[0] == h.hash_blocks(narrow + narrow)[0]
    assert h.hash_blocks(wide + narrow)[0] == h.hash_blocks(wide)[0]


def test_split_hashes_cuts_a_joined_chain():
    hashes = BlockHasher(2).hash_blocks(list(range(20)))
    blob = b"".join(hashes)
    assert split_hashes(blob) == hashes
    assert split_hashes(blob, 3) == hashes[2::3]
    assert split_hashes(b"") == []
    with pytest.raises(InvalidInput):
        split_hashes(blob[:-1])
    with pytest.raises(InvalidInput):
        BlockHasher(2).hash_blocks([1, 2.5])
    with pytest.raises(InvalidInput):
        BlockHasher(2).hash_blocks(np.array([2**63, 1], dtype=np.uint64))


def _enc_int(v: int) -> bytes:  # the hasher's tagged, length-prefixed int
    raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
    return b"\x01" + len(raw).to_bytes(4, "little") + raw


def _enc_bytes(v: bytes) -> bytes:  # the hasher's tagged, length-prefixed bytes
    return b"\x03" + len(v).to_bytes(4, "little") + v


def _reference_chain(tokens: list[int], bs: int, seed: int, tenant: bytes | None) -> list[bytes]:
    """The hash definition (module docstring) written out plainly, one block at a time."""
    import hashlib
    import struct

    prev = hashlib.sha256(HASH_VERSION + _enc_int(bs) + _enc_int(seed)).digest()
    out = []
    for i in range(len(tokens) // bs):
        block = tokens[i * bs : (i + 1) * bs]
        if all(0 <= t < 2**32 for t in block):
            row = b"\x05" + struct.pack(f"<{bs}I", *block)
        else:
            row = b"\x06" + struct.pack(f"<{bs}q", *block)
        tail = b"\x00" + (_enc_bytes(tenant) if i == 0 and tenant is not None else b"\x00")
        prev = hashlib.sha256(row + tail + prev).digest()
        out.append(prev)
    return out


@settings(max_examples=80, deadline=None)
@given(
    tokens=st.lists(
        st.one_of(
            st.integers(0, 200_000),
            st.integers(0, 2**32 - 1),
            st.integers(-(2**63), 2**63 - 1),
        ),
        max_size=400,
    ),
    bs=st.integers(1, 20),
    seed=st.integers(-3, 3),
    tenant=st.one_of(st.none(), st.binary(max_size=40)),
)
def test_the_fast_paths_hash_as_the_plain_chained_sha256(tokens, bs, seed, tenant):
    """Invariant 10's hash, whichever way the tokens arrive (a list: ``array("I")`` when
    every id fits uint32, else ``array("Q")`` or, with a negative id, ``struct``; an int64 /
    uint64 / uint32 array; a few blocks or many): the same chained sha256 as the definition
    computed block by block."""
    want = _reference_chain(tokens, bs, seed, tenant)
    h = BlockHasher(bs, seed=seed)
    assert h.hash_blocks(tokens, tenant=tenant) == want
    assert h.hash_blocks(np.array(tokens, dtype=np.int64), tenant=tenant) == want
    if all(t >= 0 for t in tokens):
        assert h.hash_blocks(np.array(tokens, dtype=np.uint64), tenant=tenant) == want
    if all(0 <= t < 2**32 for t in tokens):
        assert h.hash_blocks(np.array(tokens, dtype=np.uint32), tenant=tenant) == want


# --- the native chain (kernels/block_hash.cpp) against the Python path ---------------------


@pytest.fixture(scope="module", autouse=True)
def _native_decided():
    """Every test of this module runs the native chain where it builds, not whichever path a
    background build happens to have reached."""
    hashing.build_native()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


@contextlib.contextmanager
def python_path():
    """``hash_blocks`` on the Python path (the reference) inside the block."""
    saved = hashing._chain, hashing._native_state
    hashing._chain, hashing._native_state = None, "Python path: the test asked for it"
    try:
        yield
    finally:
        hashing._chain, hashing._native_state = saved


def _outcome(fn) -> tuple:
    try:
        return ("hashes", fn())
    except InvalidInput:
        return ("InvalidInput",)


class _Ids(Sequence):
    """A sequence that is neither a list, a tuple nor an array (vLLM's ConstantList is one)."""

    def __init__(self, ids):
        self._ids = list(ids)

    def __len__(self):
        return len(self._ids)

    def __getitem__(self, i):
        return self._ids[i]


def test_the_native_chain_builds_where_a_compiler_is():
    if os.environ.get("RAYKV_DISABLE_NATIVE_HASH", "") not in ("", "0"):
        pytest.skip("RAYKV_DISABLE_NATIVE_HASH is set")
    if _compiler() is None:
        pytest.skip("no C++ compiler: the Python path runs (tested below)")
    assert hashing.native_status().startswith("native chain"), hashing.native_status()


_ANY_ID = st.one_of(
    st.integers(0, 200_000),
    st.integers(0, 2**32 - 1),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([0, 1, 2**30 - 1, 2**30, 2**32 - 1, 2**32, -1, 2**63 - 1, -(2**63)]),
    st.booleans(),  # an int: array("I") and struct take True as 1, so must the native chain
)


@settings(max_examples=examples(150, 20_000), deadline=None)
@given(
    tokens=st.one_of(
        st.lists(_ANY_ID, max_size=300),
        st.lists(st.integers(0, 2**32 - 1), min_size=100, max_size=700),  # narrow, many blocks
    ),
    bs=st.one_of(st.integers(1, 20), st.just(16)),
    seed=st.one_of(st.integers(-3, 3), st.text(max_size=3), st.binary(max_size=3)),
    # long tenants move the parent anywhere in the first block's last chunk, or into a second
    tenant=st.one_of(st.none(), st.binary(max_size=5), st.binary(max_size=90)),
    cut=st.integers(0, 40),
    end=st.one_of(st.none(), st.integers(0, 60)),
)
def test_the_native_chain_equals_the_python_path(tokens, bs, seed, tenant, cut, end):
    """The fast path's hashes are the Python path's, bit for bit, whatever the ids (uint32,
    wide, negative, bools; blocks of either width in one prompt), block size, seed, tenant,
    range and form of the sequence (list, tuple, other sequence, uint32 / int64 / uint64
    array, contiguous or not), whole or from a parent in the middle of the chain."""
    if hashing._chain is None:
        pytest.skip(hashing.native_status())
    h = BlockHasher(bs, seed=seed)
    kw = {"end_block": end, "tenant": tenant}
    with python_path():
        want = h.hash_blocks(tokens, **kw)
    forms = [tokens, tuple(tokens), _Ids(tokens), np.array(tokens, dtype=np.int64)]
    forms.append(np.stack([forms[-1], forms[-1]], axis=1)[:, 0])  # not contiguous
    if all(t >= 0 for t in tokens):
        forms.append(np.array(tokens, dtype=np.uint64))
    if all(0 <= t < 2**32 for t in tokens):
        forms.append(np.array(tokens, dtype=np.uint32))
    for form in forms:
        assert h.hash_blocks(form, **kw) == want, type(form)
        # a lookup's form: the chain as one bytes object
        assert h.hash_blocks_joined(form, **kw) == b"".join(want), type(form)
    # from a parent in the middle: the tenant is the first block's only, the chain carries it
    first = min(cut, len(want))
    piece = {**kw, "first_block": first, "parent": want[first - 1] if first else None}
    with python_path():
        rest = h.hash_blocks(tokens, **piece)
    assert rest == want[first:]
    for form in forms:
        assert h.hash_blocks(form, **piece) == rest, type(form)


def test_the_parent_comes_last():
    """Hash ``i`` is ``sha256(row(i) + hash(i - 1))``: the parent is the message's last 32
    bytes, the tenant in the first row only."""
    import hashlib
    import struct

    h = BlockHasher(2, seed=4)
    got = h.hash_blocks([7, 8, 9, 2**40], tenant=b"s")
    first = b"\x05" + struct.pack("<2I", 7, 8) + b"\x00" + b"\x03" + struct.pack("<I", 1) + b"s"
    second = b"\x06" + struct.pack("<2q", 9, 2**40) + b"\x00\x00"
    assert got[0] == hashlib.sha256(first + h.root).digest()
    assert got[1] == hashlib.sha256(second + got[0]).digest()


def test_the_definition_is_pinned():
    """v3's bytes, pinned: a change of the definition must come with a new HASH_VERSION (and a
    new value here), on both paths. A prompt without a tenant hashes as v3 always did (the
    first value, pinned before tenants existed); a tenant's prompt under ``tenant_key`` (the
    second: tenants' keys were never stored before it, the connector refused them)."""
    ids = list(range(40)) + [2**33] * 8
    plain = "c63acd82cb2acf92e494f29ae5b77cee83cdd8e85ff42252c6716fef0a5ae44d"
    tenant = "bd16cd62e9f91c84ea9bab2a2b04e22910fe8f80ebc965ff87c5797ed5066812"
    assert HASH_VERSION == b"raykv/block-hash/v3"
    t = tenant_key("t", "adapter")
    with python_path():
        assert BlockHasher(16).hash_blocks(ids)[-1].hex() == plain
        assert BlockHasher(16).hash_blocks(ids, tenant=t)[-1].hex() == tenant
    assert BlockHasher(16).hash_blocks(ids)[-1].hex() == plain
    assert BlockHasher(16).hash_blocks(ids, tenant=t)[-1].hex() == tenant


@pytest.mark.parametrize("bs", [1, 5, 16, 17])
def test_the_native_chain_puts_the_parent_at_every_offset(bs):
    """Tenants of every length put the parent at every offset of the first block's last chunk
    (or across two), for narrow and wide rows: the native chain (its midstates, and the
    parent gathered into the last chunk) gives the Python path's."""
    if hashing._chain is None:
        pytest.skip(hashing.native_status())
    rng = np.random.default_rng(bs)
    narrow = rng.integers(0, 2**32, 6 * bs).tolist()
    wide = [t | (1 << 40) for t in narrow]
    h = BlockHasher(bs)
    for tokens in (narrow, wide, narrow[:bs] + wide[bs:]):
        for n in range(70):
            with python_path():
                want = h.hash_blocks(tokens, tenant=bytes(range(n)))
            assert h.hash_blocks(tokens, tenant=bytes(range(n))) == want, n


def test_the_joined_chain_is_the_chain_joined_on_both_paths():
    ids = list(range(3, 3 + 16 * 40 + 5))
    h = BlockHasher(16)
    with python_path():
        assert h.hash_blocks_joined(ids) == b"".join(h.hash_blocks(ids))
        assert h.hash_blocks_joined(ids[:10]) == b""
    assert h.hash_blocks_joined(ids, end_block=7) == b"".join(h.hash_blocks(ids)[:7])


def test_a_32k_token_prompt_hashes_alike_on_both_paths():
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 150_000, 32 * 1024).tolist()
    ids[5000] = 2**40  # one wide block in the middle
    h = BlockHasher(16, seed="cluster")
    with python_path():
        want = h.hash_blocks(ids, tenant=TENANT)
    assert len(want) == 2048
    assert h.hash_blocks(ids, tenant=TENANT) == want
    assert h.hash_blocks(np.array(ids), tenant=TENANT) == want
    del ids[5000]
    ids.append(1)
    with python_path():
        want = h.hash_blocks(ids)
    assert h.hash_blocks(np.array(ids, dtype=np.uint32)) == want


@pytest.mark.parametrize(
    "bad", [2.5, 2**64, 2**63, -(2**63) - 1, None, "7", np.int64(7), np.uint32(7), np.float64(1)]
)
@pytest.mark.parametrize("length", [12, 400])  # a few blocks (struct) / many (arrays)
def test_ids_the_native_chain_does_not_read_hash_or_fail_as_in_python(bad, length):
    """A list id that is not an int in the int64 range (a float, a numpy scalar, a string, an
    int past int64) is the Python path's to judge: the same hashes or the same InvalidInput."""
    tokens = list(range(length))
    tokens[length // 2] = bad
    h = BlockHasher(4)
    with python_path():
        want = _outcome(lambda: h.hash_blocks(tokens))
    assert _outcome(lambda: h.hash_blocks(tokens)) == want
    assert _outcome(lambda: h.hash_blocks(tuple(tokens))) == want


def test_threads_hash_at_once():
    """Calls from several threads at once (arrays hash without the GIL, each thread with its
    own scratch) give each its own chain."""
    rng = np.random.default_rng(3)
    prompts: list = [rng.integers(0, 2**32, 4096 + 16 * i, dtype=np.uint32) for i in range(6)]
    prompts += [rng.integers(-(2**40), 2**40, 2048 + 16 * i).tolist() for i in range(6)]
    h = BlockHasher(16)
    with python_path():
        want = [h.hash_blocks(p) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            assert list(pool.map(h.hash_blocks, prompts)) == want


_FRESH = """
import json, logging, time
logging.basicConfig(level=logging.WARNING)
from raykv.blocks import hashing
from raykv.blocks.hashing import BlockHasher
ids = list(range(1, 32 * 1024 + 1))
start = time.perf_counter()
first = BlockHasher(16).hash_blocks(ids, tenant=b"t")
took = time.perf_counter() - start
then = hashing.native_status()
status = hashing.build_native()
again = BlockHasher(16).hash_blocks(ids, tenant=b"t")
print(json.dumps({"took": took, "then": then, "status": status,
                  "hashes": [first[0].hex(), first[-1].hex()], "same": again == first}))
"""


def _fresh(tmp_path, **env) -> tuple[dict, str]:
    run = subprocess.run(
        [sys.executable, "-c", _FRESH],
        env={**os.environ, "RAYKV_CACHE_DIR": str(tmp_path / "cache"), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def test_a_fresh_machine_builds_in_the_background_and_hashes_meanwhile(tmp_path):
    """First use with an empty build cache: the call hashes in Python without waiting for the
    compiler, the build lands in $RAYKV_CACHE_DIR, and the chain is the same either way. With
    RAYKV_DISABLE_NATIVE_HASH, or a compiler that fails, the Python path runs (a warning for
    the latter) and gives the same hashes."""
    ids = list(range(1, 32 * 1024 + 1))
    want = BlockHasher(16).hash_blocks(ids, tenant=b"t")
    want = [want[0].hex(), want[-1].hex()]
    out, _ = _fresh(tmp_path)
    assert out["hashes"] == want and out["same"], out
    assert out["then"].startswith("Python path"), out  # the first call did not wait
    if _compiler() is not None and "RAYKV_DISABLE_NATIVE_HASH" not in os.environ:
        assert out["status"].startswith("native chain"), out
        assert list((tmp_path / "cache" / "block_hash").glob("*/raykv_block_hash*")), out
    out, _ = _fresh(tmp_path / "off", RAYKV_DISABLE_NATIVE_HASH="1")
    assert out["status"] == "Python path: RAYKV_DISABLE_NATIVE_HASH is set", out
    assert out["hashes"] == want and out["same"], out
    out, err = _fresh(tmp_path / "broken", CXX="false", RAYKV_DISABLE_NATIVE_HASH="")
    assert out["status"].startswith("Python path: building"), out
    assert out["hashes"] == want and out["same"], out
    assert "raykv block hashing runs in Python" in err
