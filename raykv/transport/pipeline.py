"""The C++ wire pipeline's entries (``kernels/wire_pipeline.cpp``) as raykv calls them.

``wire_send`` / ``wire_recv`` check a batch's block ids as they read them and report the first
bad one as an int, ``position * 4 + reason``, before anything is enqueued: the pipeline
formats no message and throws nothing for bad input (both took the process down on the
device's H100 host). ``pipeline_call`` words that code as raykv's ``InvalidInput``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from raykv.errors import InvalidInput

_BAD_ID_REASONS = 4  # kernels/wire_pipeline.cpp: position * 4 + reason


def bad_ids(what: str, block_ids: Sequence[int], num_blocks: int, code: int) -> InvalidInput:
    """The error for the first bad id the C++ pipeline found (``code``, see ``wire_send``;
    ``pool_read`` and ``raykv.ops.PoolCopy`` report theirs alike), worded here: the pipeline
    formats no message and throws nothing for bad input."""
    at, reason = divmod(code, _BAD_ID_REASONS)
    if reason == 1:
        return InvalidInput(f"{what}: block id at position {at} is not an int; pass ints")
    got = block_ids[at]
    if reason == 2:
        return InvalidInput(
            f"{what}: block id {got} (position {at}) is outside the pool's {num_blocks} "
            f"blocks; ids must lie in [0, {num_blocks - 1}]"
        )
    return InvalidInput(
        f"{what}: block id {got} appears more than once; each block can receive only one row"
    )


def pipeline_call(fn: Callable[..., Any], what: str, *args: Any) -> Any:
    """``fn(*args)`` (``wire_send`` or ``wire_recv``: ``args[3]`` the block ids, ``args[4]``
    the pool's block count) with the first bad block id it reports (an int code, returned
    before anything is enqueued) raised as raykv's InvalidInput; its result otherwise (None
    for a send)."""
    out = fn(*args)
    if isinstance(out, int):
        if out >= 0:
            raise bad_ids(what, args[3], args[4], out)
        return None
    return out
