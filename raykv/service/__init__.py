"""The Ray service: a named, detached ``Coordinator`` (membership, plans, the cluster-wide
prefix index), one ``GpuPool`` per GPU (a CPU-device pool on GPU-less nodes) and one
``CpuTierActor`` per node. Blocks move between them through a ``BlockMover``; the
``ObjectStoreMover`` (Ray's object store) is the slow fallback until NCCL / UCX movers exist.

Modules import Ray; ``import raykv`` does not (``raykv.connect`` loads it on first use).
"""
