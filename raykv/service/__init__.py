"""The Ray service: a named, detached ``Coordinator`` (membership, plans, the cluster-wide
prefix index), one TP group per engine instance — a ``GpuPool`` (rank 0, the group's block
manager) plus ``tp_size - 1`` ``RankPool`` actors in one STRICT_PACK placement group (CPU-
device pools on GPU-less nodes) — and one ``CpuTierActor`` per node. Any plan the layout
makes is served (hybrid groups, TP ranks, CPU-tier entries of several GPU blocks; see
``raykv.service.groups``). Blocks move between them through a ``BlockMover``; the
``ObjectStoreMover`` (Ray's object store) is the slow fallback until NCCL / UCX movers exist.

Modules import Ray; ``import raykv`` does not (``raykv.connect`` loads it on first use).
"""
