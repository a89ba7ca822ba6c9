"""The Ray service: a named, detached ``Coordinator`` (membership, plans, the cluster-wide
prefix index), one TP group per engine instance — a ``GpuPool`` (rank 0, the group's block
manager) plus ``tp_size - 1`` ``RankPool`` actors in one STRICT_PACK placement group (CPU-
device pools on GPU-less nodes) — and one ``CpuTierActor`` per node. Any plan the layout
makes is served (hybrid groups, TP ranks, CPU-tier entries of several GPU blocks; see
``raykv.service.groups``).

One data path (``raykv.service.pool.dataplane``): every byte that enters or leaves a block goes
through ``raykv.tiers`` jobs and ``raykv.ops`` paged copies. The node's CPU tier arena and
CPU-device pools' KV live in shared memory (``raykv.tiers.shm``): pools, their TP ranks and
attached engines (``raykv.engine``) run ``OffloadEngine`` Store/Load jobs on the
arena themselves, and the tier actor only keeps its metadata (reservations, leases,
checksums). Between members that do not share memory, blocks move through
``raykv.transport`` (NCCL or gloo between pools, UCX between CPU tiers, Ray's object store as
the fallback), a batch in a few large messages, verified by the receiver.
Invariant 9 is kept in ``dataplane`` (the pool's ``StoreFence`` on the block manager) and
``raykv.tiers.offload``; invariant 12 (checksum before a block is readable) in ``dataplane``,
``raykv.tiers.offload`` and ``raykv.transport.receive``.

Packages: ``control`` (the coordinator and its calls), ``pool`` (the pool actors and their
data path), ``tier`` (the CPU tier actor), ``node`` (the node agent engines talk to, and the
index replica they read). ``served`` names what the service serves (``ServedModel``) and its
actors; ``groups`` maps a plan's groups to blocks and keys; ``member`` is what every pool
and tier does as a member of the coordinator's cluster.

Modules import Ray, except those the engine side uses without it (``served``, ``groups``,
``node.agent_protocol``, ``node.replica``); ``import raykv`` loads none of them
(``raykv.connect`` loads Ray on first use).
"""
