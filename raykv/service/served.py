"""What the service serves: one ``ServedModel`` per model name, planned once per model, and
the names its actors go by. (What a client call takes and returns is ``raykv.api``'s.)

A model's plan is the same for every pool (one TP rank of one GPU, or a CPU-device pool),
so every pool's block ids, row bytes and block keys agree and blocks move between them as
plain rows of bytes. ``tp_size`` ranks of one engine instance form one TP group: a
``GpuPool`` (rank 0) plus ``tp_size - 1`` ``RankPool`` actors in one placement group.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from numbers import Real

from raykv.api import short_repr
from raykv.errors import ConfigError
from raykv.layout.sizing import check_whole
from raykv.layout.specs import KVSpec

NAMESPACE = "raykv"
COORDINATOR = "raykv-coordinator"
DEFAULT_POOL_BYTES = 2 << 30  # KV bytes of a CPU-device pool (dev and CI)
DEFAULT_TIER_BYTES = 512 << 20  # CPU-tier bytes per node and model


def pool_name(model: str, node_id: str, index: int) -> str:
    return f"raykv-pool-{model}-{node_id[:12]}-{index}"


def tier_name(node_id: str) -> str:
    return f"raykv-tier-{node_id[:12]}"


def rank_name(pool: str, rank: int) -> str:
    """Rank ``rank`` (>= 1) of the TP group whose rank 0 is the pool ``pool``."""
    return "raykv-rank-" + pool.removeprefix("raykv-pool-") + f"-r{rank}"


def group_name(pool: str) -> str:
    """The placement group of the TP group whose rank 0 is the pool ``pool``."""
    return "raykv-tp-" + pool.removeprefix("raykv-pool-")


# ServedModel's whole-number settings: (field, least value, the fix an error names)
_MODEL_INTS = (
    ("max_model_len", 1, "pass the longest request in tokens as an int, e.g. max_model_len=4096"),
    ("max_num_batched_tokens", 1, "pass the tokens of one step as an int, e.g. 8192"),
    ("block_size", 1, "pass the tokens per block as an int, e.g. block_size=16"),
    ("tp_size", 1, "pass the TP ranks per engine instance as an int, e.g. tp_size=1"),
    (
        "pool_bytes",
        0,
        "pass the KV bytes per pool (per rank) as an int, e.g. pool_bytes=64 << 20 (64 MiB), "
        "or 0 for the default (gpu_mem_fraction of a GPU; 2 GiB for a CPU-device pool)",
    ),
    (
        "cpu_bytes",
        0,
        "pass the CPU-tier bytes per node as an int, e.g. cpu_bytes=512 << 20 (512 MiB), "
        "or 0 for no CPU tier",
    ),
    (
        "offload_block_size",
        1,
        "pass the tokens per CPU-tier entry as an int (a multiple of block_size), or None",
    ),
)


@dataclass(frozen=True)
class ServedModel:
    """A model the service holds KV for. ``pools`` False: no pools at all (the CPU tiers and
    the prefix index only; ``pool_bytes`` then only sizes the plan). ``pool_bytes`` 0:
    ``gpu_mem_fraction`` of the GPU's memory on GPU pools, ``DEFAULT_POOL_BYTES`` on
    CPU-device pools. Any layer mix the
    layout plans is served as long as every group is prefix-cacheable (no Mamba / cross
    attention); ``offload_block_size`` a multiple of the block size makes CPU-tier entries
    of several GPU blocks."""

    name: str
    layers: Mapping[str, KVSpec] = field(hash=False)
    max_model_len: int
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    tp_size: int = 1  # ranks per engine instance: per-rank pool bytes, one pool actor each
    gpu_mem_fraction: float = 0.9
    pool_bytes: int = 0  # KV bytes per rank
    cpu_bytes: int = DEFAULT_TIER_BYTES
    offload_block_size: int | None = None  # tokens per CPU-tier entry (default block_size)
    # False: the CPU tiers and the index only, no pools. For engines that keep their own KV
    # (vLLM's connector): a pool takes a whole GPU that the engine needs
    pools: bool = True

    def __post_init__(self) -> None:
        if (
            not isinstance(self.name, str)
            or not self.name
            or not self.name.replace("-", "").replace("_", "").replace(".", "").isalnum()
        ):
            raise ConfigError(
                f"model name {self.name!r} must be letters, digits, '-', '_' or '.'; rename it"
            )
        if not isinstance(self.layers, Mapping) or not self.layers:
            raise ConfigError(
                f"model {self.name!r} has no KV layers (got {short_repr(self.layers)}); pass a "
                "dict of layer name -> spec (raykv.layout.FullAttention & co.)"
            )
        if not isinstance(self.pools, bool):
            raise ConfigError(
                f"pools must be True or False, got {short_repr(self.pools)}; pass False for a "
                "model whose engines keep their own KV (the CPU tiers and the index only)"
            )
        frac = self.gpu_mem_fraction
        if isinstance(frac, bool) or not isinstance(frac, Real) or not 0 < frac <= 1:
            raise ConfigError(
                f"gpu_mem_fraction must be a number in (0, 1], got {short_repr(frac)} "
                f"({type(frac).__name__}); pass the share of a GPU's memory for KV, e.g. 0.9"
            )
        # every size and count a whole number (never a float, nan, inf or bool): the pools
        # and tiers are sized from them, so a refused one must fail here, on the caller
        for what, least, fix in _MODEL_INTS:
            value = getattr(self, what)
            if value is not None or what != "offload_block_size":
                object.__setattr__(self, what, check_whole(value, what, minimum=least, fix=fix))

    def plan(self, gpu_bytes: int):
        from raykv.layout import plan

        return plan(
            dict(self.layers),
            gpu_bytes=gpu_bytes,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            tp_size=self.tp_size,
            cpu_bytes=self.cpu_bytes,
            block_size=self.block_size,
            offload_block_size=self.offload_block_size,
        )


def served_model(
    name: object, layers: object, max_model_len: object, settings: Mapping[str, object]
) -> ServedModel:
    """``ServedModel`` from a caller's ``add_model`` arguments: a setting it does not have,
    or layers that are no mapping, raise ConfigError (not TypeError) naming the fix."""
    fields = sorted(f for f in ServedModel.__dataclass_fields__ if f not in ("name", "layers"))
    unknown = sorted(set(settings) - set(fields))
    if unknown:
        raise ConfigError(
            f"add_model has no setting {', '.join(map(repr, unknown))}; pass only "
            f"max_model_len= and these: {', '.join(f for f in fields if f != 'max_model_len')}"
        )
    if not isinstance(layers, Mapping):
        raise ConfigError(
            f"model {name!r}: layers must be a dict of layer name -> KV spec, got "
            f"{short_repr(layers)} ({type(layers).__name__}); e.g. {{'l0': FullAttention(...)}}"
        )
    return ServedModel(name, dict(layers), max_model_len, **settings)  # type: ignore[arg-type]
