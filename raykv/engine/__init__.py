"""The engine's side of raykv, with no Ray in the engine's process.

An engine (a vLLM scheduler or worker, or any process that keeps its own paged KV) talks
to its node's raykv through the node agent (the node's CPU tier, inside Ray) over a local
socket (``agent``: a connection behind a circuit breaker), answers lookups from the node's
prefix index replica in shared memory (``node``), and copies blocks between its own KV and
the node's CPU tier through shared memory (``attached``). Nothing here imports Ray: an
engine's life is not tied to the Ray head, and a dead service is a miss, never a wait.
"""

from raykv.engine.agent import AgentUnavailable, NodeAgent
from raykv.engine.attached import AttachedKV, TierLease
from raykv.engine.node import EngineLookup, NodeKV

__all__ = ["AgentUnavailable", "AttachedKV", "EngineLookup", "NodeAgent", "NodeKV", "TierLease"]
