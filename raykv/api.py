"""The client API's values, below the service: what a call's arguments must be and what a
call returns.

* Input checks, one per concept (request ids, token counts, token ids, block ids): ``Client``
  runs each once per call, before any actor call, so bad input raises a ``raykv.errors``
  error in the caller's process and reaches no actor. The pool takes what the client checked
  and re-checks only what it alone can: ownership (a request, and its blocks, belong to the
  client that admitted it), its plan's limits (``check_token_count`` against
  ``max_model_len``, the groups, the TP ranks) and a request's state.
* Result types: ``LookupResult`` (with its ``Hit`` runs), ``LoadResult``, ``StoreResult``
  (``raykv.LookupResult`` & co.); the pool builds ``StoreResult`` itself.
"""

from __future__ import annotations

import array
import contextlib
import operator
from collections.abc import Hashable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass

import numpy as np

from raykv.blocks.hashing import narrow_array, token_array
from raykv.errors import InvalidInput

# --- caller input ---------------------------------------------------------------------------


def short_repr(value: object) -> str:
    """``repr(value)``, cut to about 60 characters: how an error shows what it refused."""
    text = repr(value)
    return f"{text[:60]}..." if len(text) > 63 else text


def check_int(value: object, what: str, fix: str) -> int:
    """``value`` as a Python int. Ints and numpy / torch integer scalars pass; bools (an int
    subclass), floats (never truncated: 21.5 is no id), strings and None raise InvalidInput
    naming the value, its type and ``fix``."""
    dtype = getattr(value, "dtype", None)
    if not isinstance(value, bool) and (dtype is None or "bool" not in str(dtype)):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise InvalidInput(
        f"{what} must be an integer, got {short_repr(value)} ({type(value).__name__}); {fix}"
    )


def check_count(value: object, what: str) -> int:
    """A token count (``num_tokens``, ``num_new_tokens``): an integer >= 0."""
    n = check_int(value, what, f"pass the number of tokens as an int, e.g. {what}=len(token_ids)")
    if n < 0:
        raise InvalidInput(f"{what} must be >= 0, got {n}; pass the number of tokens (0 or more)")
    return n


def check_request_id(request_id: object) -> Hashable:
    """Request ids key the pool's tables: any hashable value but None (a str or an int is
    usual; None is what a forgotten id looks like, so it names no request)."""
    if request_id is None:
        raise InvalidInput(
            "request id None names no request; use a str or an int that identifies the "
            "request (e.g. the engine's request id)"
        )
    try:
        hash(request_id)
    except TypeError:
        raise InvalidInput(
            f"request id {short_repr(request_id)} ({type(request_id).__name__}) is not hashable; "
            "use a str or an int (e.g. str(request_id))"
        ) from None
    return request_id


def check_admit(num_tokens: int, token_ids: list[int] | None) -> None:
    """What ``admit`` takes beyond its checked arguments: a request of at least one token,
    and never fewer tokens than the token ids it is given. ``num_tokens`` sizes the request
    at the admission gate; ``token_ids`` are its tokens known now, the prompt (a request may
    reserve more, e.g. ``len(prompt) + 1`` for its first decode step); a count below them
    would leave tokens it was given unreserved and unhashed."""
    if token_ids is not None and num_tokens < len(token_ids):
        raise InvalidInput(
            f"admit got num_tokens={num_tokens} but {len(token_ids)} token ids; the count is "
            "the request's size, at least its prompt's: pass admit(request_id, len(prompt), "
            "prompt) (or more, to reserve decode steps too)"
        )
    if num_tokens == 0:
        raise InvalidInput(
            "admit got an empty request (num_tokens=0 and no token ids); a request has at "
            "least one prompt token: pass admit(request_id, len(prompt), prompt)"
        )


BLOCK_ID_FIX = "pass the int block ids that allocate / block_table returned"


def _is_seq(x: object) -> bool:
    return isinstance(x, (list, tuple)) or getattr(x, "ndim", 0) > 0


def _plain_ints(seq: object) -> list[int] | None:
    """A plain list / tuple of plain ints (what ``allocate`` returns) as a list, in one
    pass of C (a 32k-token prompt's 2048 ids: no Python step each); None for anything else
    (``check_int`` then looks at each item)."""
    if type(seq) not in (list, tuple):
        return None
    items: Sequence = seq  # type: ignore[assignment]
    return list(items) if operator.countOf(map(type, items), int) == len(items) else None


def check_block_ids(block_ids: object) -> list:
    """Block ids as plain ints: one flat list, or one list per group (as ``allocate``
    returns them). Kernel block ids, floats, bools, strings and non-sequences raise
    InvalidInput. Whether they belong to a request is the pool's check."""
    from raykv.layout.kernel_blocks import require_logical

    if not _is_seq(block_ids):
        raise InvalidInput(
            f"block ids must be a list of ints (or one list per KV group), got "
            f"{short_repr(block_ids)} ({type(block_ids).__name__}); {BLOCK_ID_FIX}"
        )
    require_logical(block_ids, "the service")
    flat = _plain_ints(block_ids)
    if flat is not None:
        return flat
    out: list = []
    for t in block_ids:  # type: ignore[attr-defined]
        if _is_seq(t):
            require_logical(t, "the service")
            ints = _plain_ints(t)
            out.append(ints if ints is not None else
                       [check_int(b, "block ids", BLOCK_ID_FIX) for b in t])  # fmt: skip
        else:
            out.append(check_int(t, "block ids", BLOCK_ID_FIX))
    if any(isinstance(t, list) for t in out) and not all(isinstance(t, list) for t in out):
        raise InvalidInput(
            "block ids mix ints and lists: pass one flat list of ints or one list per KV group"
        )
    return out


_TOKEN_FIX = "pass the prompt's token ids as a sequence of integers (a list or an integer array)"


def check_token_ids(
    token_ids: Sequence[int], max_model_len: int | None = None, model: str = ""
) -> list[int]:
    """Token ids as a list of ints; raises InvalidInput (changing nothing) on bad input.
    A sequence, array or tensor of integers: floats are refused, not truncated (1.5 is no
    token id); bools, mappings (a dict would give its keys), sets and strings are refused.
    ``max_model_len`` None: no length check (a pool call's: the pool checks the length
    against its plan, ``check_token_count``)."""
    dtype = getattr(token_ids, "dtype", None)
    if dtype is not None and ("int" not in str(dtype) or "bool" in str(dtype)):
        raise InvalidInput(f"token ids must have an integer dtype, got {dtype}; {_TOKEN_FIX}")
    if dtype is not None and hasattr(token_ids, "tolist"):
        token_ids = token_ids.tolist()  # a tensor or array: one conversion, not one per id
    if isinstance(token_ids, (str, bytes, bytearray, Mapping, Set)) or not isinstance(
        token_ids, Iterable
    ):
        raise InvalidInput(
            f"token ids must be a sequence of integers, got {short_repr(token_ids)} "
            f"({type(token_ids).__name__}); {_TOKEN_FIX}"
        )
    ids = list(token_ids)
    if set(map(type, ids)) - {int}:  # anything but a plain list of ints: check each id
        ids = [check_int(t, f"token id at position {i}", _TOKEN_FIX) for i, t in enumerate(ids)]
    check_token_count(len(ids), max_model_len, model)
    if ids and min(ids) < 0:
        raise InvalidInput(f"token ids must be >= 0, got {min(ids)}")
    return ids


def check_token_count(n: int, max_model_len: int | None, model: str) -> None:
    """``n`` token ids fit model ``model``'s ``max_model_len`` (None: no limit)."""
    if max_model_len is not None and n > max_model_len:
        raise InvalidInput(
            f"{n} token ids exceed model {model!r}'s max_model_len={max_model_len}; "
            "truncate the prompt or serve the model with a larger max_model_len"
        )


def token_id_array(
    token_ids: Sequence[int], max_model_len: int | None = None, model: str = ""
) -> np.ndarray:
    """``check_token_ids`` for hashing (a lookup): the same checks and InvalidInput errors,
    giving one array and no list: uint32 when every id fits (the usual prompt; the hasher
    takes it without a range check), else int64.

    A list of ints becomes an array in one C pass (``array("I")``, else ``array("Q")``: a
    float, a string or a negative id stops it) and a 1-D integer numpy array is used as it
    is; numpy then checks them. Of the ids that pass, only those equal to 0 or 1 can be
    bools (refused, as ``check_int`` refuses them), so only those are looked at one by one.
    Anything else, and anything refused, goes through ``check_token_ids``, which names the
    offending id."""
    arr = None
    if isinstance(token_ids, list):
        arr = narrow_array(token_ids)
        if arr is None:
            with contextlib.suppress(TypeError, OverflowError):
                arr = np.frombuffer(array.array("Q", token_ids), np.uint64)
        if arr is not None:
            for i in np.flatnonzero(arr <= 1).tolist():
                check_int(token_ids[i], f"token id at position {i}", _TOKEN_FIX)
    elif isinstance(token_ids, np.ndarray) and token_ids.dtype.kind in "iu" and token_ids.ndim == 1:
        arr = token_ids
    if arr is None:
        return token_array(check_token_ids(token_ids, max_model_len, model))
    check_token_count(arr.size, max_model_len, model)
    if arr.dtype.kind == "i" and arr.size and int(arr.min()) < 0:
        raise InvalidInput(f"token ids must be >= 0, got {int(arr.min())}")
    return arr if arr.dtype == np.uint32 else token_array(arr)


# --- what the client's calls return ---------------------------------------------------------


@dataclass(frozen=True)
class Hit:
    """A run of consecutive hit blocks served from one tier of one node."""

    tier: str  # "gpu" or "cpu"
    node_id: str
    local: bool  # on the caller's node
    num_tokens: int


@dataclass(frozen=True)
class LookupResult:
    hit_tokens: int  # leading tokens whose KV some pool or tier holds (< len(token_ids))
    where: tuple[Hit, ...]
    num_tokens: int  # tokens looked up

    @property
    def local_tokens(self) -> int:
        return sum(h.num_tokens for h in self.where if h.local and h.tier == "gpu")


@dataclass(frozen=True)
class LoadResult:
    num_tokens: int  # leading tokens of the request now backed by written KV
    loaded_blocks: int  # blocks copied into ``into``
    bytes: int  # bytes that came from another tier or node
    seconds: float


class StoreResult(int):
    """What ``store`` did. Its int value is the number of blocks newly published (so
    ``store(...) == n`` reads as it always did); ``written`` counts the blocks whose bytes
    were written; ``skipped`` lists, per group, the block ids left untouched because their
    bytes are immutable (published, or being written by another call)."""

    written: int
    skipped: list[list[int]]

    def __new__(
        cls, published: int, written: int = 0, skipped: list[list[int]] | None = None
    ) -> StoreResult:
        self = super().__new__(cls, published)
        self.written, self.skipped = written, skipped or []
        return self

    def __reduce__(self) -> tuple:
        return (StoreResult, (int(self), self.written, self.skipped))

    @property
    def published(self) -> int:
        return int(self)

    @property
    def num_skipped(self) -> int:
        return sum(len(s) for s in self.skipped)

    def __repr__(self) -> str:
        return f"StoreResult(published={int(self)}, written={self.written}, skipped={self.skipped})"

    def __str__(self) -> str:  # prints as the count, like the int store used to return
        return str(int(self))

    __format__ = int.__format__
