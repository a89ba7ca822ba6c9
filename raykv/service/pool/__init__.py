"""The pool: one engine instance's TP group of paged KV as Ray actors: ``GpuPool`` (rank 0,
the group's block manager; ``gpu_pool``) and the ``RankPool`` actors of ranks 1..tp-1
(``rank``), who owns each request and which blocks are valid (``requests``), the rows a
call carries (``rows``), and the ways its bytes move (``dataplane``: the node's CPU tier and
fetches; ``fanout``: to and from the ranks; ``pairs``: the direct routes between pools, NCCL
pairs and peer reads, driven rank to rank through ``raykv.transport.collective``).
"""
