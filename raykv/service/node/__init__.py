"""What an engine process on a node talks to: the node agent (``agent``: served inside the
node's ``CpuTierActor``), the wire it speaks (``agent_protocol``) and the node's prefix index
replica in shared memory (``replica``).

``agent_protocol`` and ``replica`` import no Ray: the engine's side (``raykv.engine``) uses
them in processes that never join Ray; this package's ``__init__`` must stay as light.
"""
