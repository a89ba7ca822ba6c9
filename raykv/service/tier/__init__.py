"""The CPU tier of one node as a Ray actor (``actor``: ``CpuTierActor``, the metadata of the
node's shared arena, serving the node agent) and its pulls of entries from other nodes'
tiers (``pull``)."""
