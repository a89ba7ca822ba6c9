"""Block to block between two pools of one layout: ``PoolCopy``.

A peer read (``raykv.transport.peer_read``) copies another process's pool, mapped into this
one, straight into its own blocks; its holder states the wire sums of its blocks with the same
class (no destination). The CUDA path is one extension call per batch (``pool_read`` in
``kernels/wire_pipeline.cpp``: the ids read and checked from the caller's lists, uploaded, the
copy ``raykv_pool_copy`` with each row's wire sum, the sums back); elsewhere the torch
reference of ``raykv.ops`` gives the same bytes and sums.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from raykv.errors import InvalidInput, TransportError
from raykv.ops import _CTAS, _load, _segment_table, _spans_aligned, row_segments
from raykv.ops.checks import _entries_key, _entries_shape, bad_ids
from raykv.ops.reference import gather_reference, row_sums, scatter_reference


class PoolCopy:
    """Block-to-block copies between two pools of one layout (the source may be another
    process's pool mapped into this one, ``raykv.tiers.peer_memory``), or the sums alone of
    one pool's blocks (``dst_entries`` None): the pools checked and the kernel's segment
    tables prepared once, so a batch costs one extension call that reads its ids straight
    from the caller's lists (``kernels/wire_pipeline.cpp``, ``pool_read``; a peer reader
    keeps one per mapped pool). Each row's wire sum comes back exactly as ``gather_blocks``
    of the source takes it. The torch reference runs where the kernel cannot."""

    def __init__(
        self, src_entries: Sequence[torch.Tensor], dst_entries: Sequence[torch.Tensor] | None = None
    ) -> None:
        self.what = "peer read" if dst_entries is not None else "block sums"
        self.src = list(src_entries)
        src_key = _entries_key(self.src, self.what)
        self.width, self.num_src = _entries_shape(self.src, src_key, self.what)
        self.dst = list(dst_entries) if dst_entries is not None else None
        self.num_dst, dst_key = 0, None
        self.device = self.src[0].device
        if self.dst is not None:
            dst_key = _entries_key(self.dst, self.what)
            width, self.num_dst = _entries_shape(self.dst, dst_key, self.what)
            spans = [(sg[2], sg[3]) for sg in row_segments(self.src)]
            if width != self.width or spans != [(sg[2], sg[3]) for sg in row_segments(self.dst)]:
                raise InvalidInput(
                    f"{self.what}: the pools' rows differ ({self.width} vs {width} bytes, or "
                    "spans at other offsets); both must hold one layout (the same plan and rank)"
                )
            if self.dst[0].device != self.device:
                raise InvalidInput(
                    f"{self.what}: the source is on {self.device} but the destination on "
                    f"{self.dst[0].device}; map the source into the destination's device"
                )
        self._events: list[torch.cuda.Event] = []  # events whose last record has passed
        self._module = None
        module = _load() if self.device.type == "cuda" else None
        if (
            module is not None
            and hasattr(module, "pool_read")
            and _spans_aligned(self.src, src_key)
        ):
            with torch.cuda.device(self.device):
                # the kernel's running sums, zero between batches (it leaves them so), and the
                # stream the last batch went to (a batch on another stream waits for it)
                self._scratch = torch.zeros(module.pool_batch_rows + 1, dtype=torch.int64,
                                            device=self.device)  # fmt: skip
                self._state = torch.zeros(1, dtype=torch.int64)
                self._src_table = _segment_table(self.src, src_key)
                self._dst_table = (
                    _segment_table(self.dst, dst_key) if self.dst is not None
                    else torch.empty((0, 4), dtype=torch.int64, device=self.device)
                )  # fmt: skip
            self._module = module

    def start(
        self,
        src_ids: Sequence[int],
        dst_ids: Sequence[int] | None = None,
        done: torch.cuda.Event | None = None,
    ) -> torch.Tensor:
        """Checks and enqueues one batch on the current stream: block ``dst_ids[i]`` = block
        ``src_ids[i]`` (no ``dst_ids`` without a destination: nothing is written). Returns
        the batch's result, int64 ``[2n]`` (on a GPU pinned host memory the kernel writes,
        complete once the stream passes this point; ``done``, an ``event()``, is recorded
        there): ``sums`` reads the rows' sums from it. InvalidInput naming
        the id, its position and the pool's size where an id is not an int, lies outside its
        pool or is written twice, or the counts differ; nothing is enqueued then."""
        n = len(src_ids)
        if (self.dst is None) != (dst_ids is None) or (dst_ids is not None and len(dst_ids) != n):
            got = "no" if dst_ids is None else len(dst_ids)
            raise InvalidInput(f"{self.what}: {n} source ids but {got} destination ids")
        if self._module is not None:
            out = self._module.pool_read(self._src_table, self._dst_table, src_ids, dst_ids,
                                         self.num_src, self.num_dst, _CTAS,
                                         done.cuda_event if done is not None else 0,
                                         self._scratch, self._state)  # fmt: skip
            if isinstance(out, tuple):
                side, code = out
                ids, size = (src_ids, self.num_src) if side == 0 else (dst_ids, self.num_dst)
                raise bad_ids(f"{self.what} ({('source', 'destination')[side]})", ids, size, code)
            return out
        for side, (ids, size) in enumerate(((src_ids, self.num_src), (dst_ids, self.num_dst))):
            code = _first_bad(ids, size, distinct=side == 1) if ids is not None else -1
            if code >= 0:
                raise bad_ids(f"{self.what} ({('source', 'destination')[side]})", ids, size, code)
        out = torch.ones(2 * n, dtype=torch.int64)  # the sums, then every row's flag set
        if n:  # the torch reference
            rows = torch.empty((n, self.width), dtype=torch.uint8, device=self.device)
            gather_reference(self.src, torch.tensor(src_ids, device=self.device), rows)
            out[:n].copy_(row_sums(rows))
            if self.dst is not None:
                scatter_reference(rows, self.dst, torch.tensor(dst_ids, device=self.device))
        return out

    def leading_good(self, got: torch.Tensor, sent: Sequence[int] | np.ndarray) -> int:
        """How many leading rows of ``start``'s result ``got`` (its batch passed) came back
        with the sum ``sent`` states for each (compared up to ``len(sent)`` rows): only those
        may become valid; a row whose sum was not handed back ends them. On a GPU one pass in
        the extension (``pool_leading``; numpy's compare, mask and search cost ~12 us a read)."""
        want = np.asarray(sent, dtype=np.int64)  # free for the int64 array stated_sums gives
        if self._module is not None:
            return self._module.pool_leading(got, want)
        out = got.numpy()
        n = len(out) // 2
        m = min(n, len(want))
        bad = np.flatnonzero((out[:m] != want[:m]) | (out[n : n + m] == 0))
        return int(bad[0]) if bad.size else m

    def sums(self, got: torch.Tensor) -> np.ndarray:
        """The rows' wire sums (int64 ``[n]``, a view of ``got``) from ``start``'s result, once
        its batch has passed. TransportError where the kernel did not hand back a row's sum
        (its flag unset): the batch is then no good as a whole (its flags are how a sum left
        over from an earlier batch in the same pinned memory can never pass for this one's)."""
        out = got.numpy()
        n = len(out) // 2
        if not out[n:].all():
            raise TransportError(
                f"{self.what}: the copy handed back {int(np.count_nonzero(out[n:]))} of {n} "
                "rows' sums (a kernel fault); the batch is a miss"
            )
        return out[:n]

    def event(self) -> torch.cuda.Event:
        """A CUDA event for ``start``'s ``done``, which the kernel's call records behind its
        batch on the stream the batch went to (no stream lookup, no fresh event per batch:
        ~9 us of Python, measured against a 0.14 ms read of 32 MiB); ``reuse`` it once it
        has passed."""
        if self._events:
            return self._events.pop()
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))  # creates its cudaEvent_t here
        return done

    def reuse(self, done: torch.cuda.Event) -> None:
        self._events.append(done)


def _first_bad(ids: Sequence[int], num_blocks: int, distinct: bool) -> int:
    """``kernels/wire_pipeline.cpp``'s check of a batch's ids, in Python (the reference path):
    -1, or the first bad id's ``position * 4 + reason`` (1 not an int, 2 outside, 3 twice)."""
    seen: set[int] = set()
    for i, b in enumerate(ids):
        if not isinstance(b, int | np.integer) or isinstance(b, bool):
            return i * 4 + 1
        if not 0 <= b < num_blocks:
            return i * 4 + 2
        if distinct and b in seen:
            return i * 4 + 3
        seen.add(int(b))
    return -1
