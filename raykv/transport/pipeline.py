"""The C++ wire pipeline's entries (``kernels/wire_pipeline.cpp``) as raykv calls them.

``wire_send`` / ``wire_recv`` check a batch's block ids as they read them and report the first
bad one as an int, ``position * 4 + reason``, before anything is enqueued: the pipeline
formats no message and throws nothing for bad input (both took the process down on the
device's H100 host). ``pipeline_call`` words that code as raykv's ``InvalidInput``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from raykv.ops import bad_ids


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
