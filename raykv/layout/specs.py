"""KV specs: what one layer keeps per token (or per request) and how many bytes a block takes.

Every spec is a frozen dataclass. ``page_bytes(block_size, tp_size)`` is the bytes one
block of one layer takes on ONE tensor-parallel rank. ``distinct_copies(tp_size)`` is how
many different copies of that page exist across the TP group: ``tp_size`` when heads are
split across ranks, 1 when every rank holds the same bytes (MLA's latent; invariant 5).
The TP arithmetic itself (heads per rank, copies, writers, CPU-tier bytes) is in
``raykv.layout.tp``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from raykv.errors import ConfigError
from raykv.layout.tp import head_copies, split_heads

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ConfigError(f"unknown KV dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}") from None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVSpec:
    """Base of all specs. ``kind`` names the manager that serves the layer."""

    dtype: str = "bfloat16"

    kind = "base"
    #: True when a request's blocks cover every token (its prefix can be cached and shared).
    cacheable = True

    def page_bytes(self, block_size: int, tp_size: int = 1) -> int:
        raise NotImplementedError

    def distinct_copies(self, tp_size: int) -> int:
        """Different copies of one page across the TP group (invariant 5)."""
        return tp_size

    def max_blocks(self, num_tokens: int, block_size: int, max_num_batched_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens ever holds, when each step
        adds at most ``max_num_batched_tokens`` tokens (the in-flight chunk).

        This is the one admission formula (invariant 2): the planner sizes with it, the
        block manager's admission gate checks with it, and every step of an admitted
        request, alone on an empty pool, fits in it. It is never applied per step.
        """
        return cdiv(num_tokens, block_size)

    def type_key(self) -> tuple:
        """Specs with equal type keys can share one group (same manager, same window)."""
        return (self.kind,)


@dataclass(frozen=True)
class FullAttention(KVSpec):
    num_kv_heads: int = 8
    head_dim: int = 128

    kind = "full"

    def __post_init__(self) -> None:
        dtype_bytes(self.dtype)
        if self.num_kv_heads < 1 or self.head_dim < 1:
            raise ConfigError(
                f"attention needs num_kv_heads >= 1 and head_dim >= 1, got "
                f"{self.num_kv_heads} and {self.head_dim}"
            )

    def kv_heads_per_rank(self, tp_size: int) -> int:
        return split_heads(self.num_kv_heads, tp_size)

    def page_bytes(self, block_size: int, tp_size: int = 1) -> int:
        # K and V: 2 x block_size x heads x head_dim
        return (
            2
            * block_size
            * self.kv_heads_per_rank(tp_size)
            * self.head_dim
            * dtype_bytes(self.dtype)
        )

    def distinct_copies(self, tp_size: int) -> int:
        return head_copies(self.num_kv_heads, tp_size)


@dataclass(frozen=True)
class SlidingWindow(FullAttention):
    window: int = 4096

    kind = "sliding_window"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ConfigError(f"sliding window must be >= 1 token, got {self.window}")

    def max_blocks(self, num_tokens: int, block_size: int, max_num_batched_tokens: int) -> int:
        # Admission cap, applied only at the gate. A step of n new tokens after c computed
        # ones holds the window - 1 tokens before position c plus the n new ones, and the
        # first of them sits anywhere in its block (up to block_size - 1 tokens in): at
        # most cdiv(window - 1 + n + block_size - 1, block_size) blocks, n up to
        # max_num_batched_tokens. Leaving out the in-flight chunk (or the block edge)
        # admits requests that can then never run, even alone on an empty pool (inv. 2).
        span = self.window - 1 + max_num_batched_tokens + block_size - 1
        return min(cdiv(num_tokens, block_size), cdiv(span, block_size))

    def type_key(self) -> tuple:
        return (self.kind, self.window)


@dataclass(frozen=True)
class ChunkedLocal(FullAttention):
    chunk: int = 8192

    kind = "chunked_local"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk < 1:
            raise ConfigError(f"attention chunk must be >= 1 token, got {self.chunk}")

    def max_blocks(self, num_tokens: int, block_size: int, max_num_batched_tokens: int) -> int:
        # The current attention chunk so far (at most chunk - 1 tokens) plus the in-flight
        # step. Attention chunks start at multiples of ``chunk``, so the first of those
        # tokens sits at most block_size - gcd(chunk, block_size) tokens into its block.
        lead = block_size - math.gcd(self.chunk, block_size)
        span = self.chunk - 1 + max_num_batched_tokens + lead
        return min(cdiv(num_tokens, block_size), cdiv(span, block_size))

    def type_key(self) -> tuple:
        return (self.kind, self.chunk)


@dataclass(frozen=True)
class CrossAttention(FullAttention):
    """Encoder KV, allocated once per request for ``max_encoder_len`` tokens."""

    max_encoder_len: int = 1500

    kind = "cross"
    cacheable = False

    def max_blocks(self, num_tokens: int, block_size: int, max_num_batched_tokens: int) -> int:
        return cdiv(self.max_encoder_len, block_size)

    def type_key(self) -> tuple:
        return (self.kind, self.max_encoder_len)


@dataclass(frozen=True)
class MLA(KVSpec):
    """Multi-head latent attention: one latent (+ rope part) per token, replicated on every
    TP rank, so the CPU tier stores it once."""

    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64

    kind = "mla"

    def __post_init__(self) -> None:
        dtype_bytes(self.dtype)
        if self.kv_lora_rank < 1 or self.qk_rope_head_dim < 0:
            raise ConfigError(
                f"MLA needs kv_lora_rank >= 1 and qk_rope_head_dim >= 0, got "
                f"{self.kv_lora_rank} and {self.qk_rope_head_dim}"
            )

    def page_bytes(self, block_size: int, tp_size: int = 1) -> int:
        return block_size * (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes(self.dtype)

    def distinct_copies(self, tp_size: int) -> int:
        return 1


@dataclass(frozen=True)
class Mamba(KVSpec):
    """Recurrent state (conv + SSM) of one request. ``state_shapes`` are the full (TP=1)
    shapes; dimension ``tp_split_dim`` of each is divided across TP ranks."""

    state_shapes: tuple[tuple[int, ...], ...] = ((8192, 3), (128, 64, 128))
    tp_split_dim: int = 0

    kind = "mamba"
    cacheable = False

    def __post_init__(self) -> None:
        dtype_bytes(self.dtype)
        bad = [s for s in self.state_shapes if not s or min(s) < 1]
        if not self.state_shapes or bad:
            raise ConfigError(
                f"Mamba state shapes must be non-empty with every dim >= 1, got {self.state_shapes}"
            )
        if any(not 0 <= self.tp_split_dim < len(s) for s in self.state_shapes):
            raise ConfigError(
                f"Mamba tp_split_dim {self.tp_split_dim} is outside state shapes "
                f"{self.state_shapes}"
            )

    def state_shapes_per_rank(self, tp_size: int) -> tuple[tuple[int, ...], ...]:
        out = []
        for shape in self.state_shapes:
            d = self.tp_split_dim
            if shape[d] % tp_size:
                raise ConfigError(
                    f"Mamba state shape {shape} dim {d} ({shape[d]}) does not split across "
                    f"tp_size={tp_size}; use a tp_size that divides {shape[d]}"
                )
            out.append(tuple(s // tp_size if i == d else s for i, s in enumerate(shape)))
        return tuple(out)

    def page_bytes(self, block_size: int, tp_size: int = 1) -> int:
        # One block holds the whole state whatever the block size.
        return sum(math.prod(s) for s in self.state_shapes_per_rank(tp_size)) * dtype_bytes(
            self.dtype
        )

    def max_blocks(self, num_tokens: int, block_size: int, max_num_batched_tokens: int) -> int:
        return 1


ATTENTION_KINDS = frozenset({"full", "sliding_window", "chunked_local", "cross", "mla"})
