"""Faults a test puts into a reader pool through ``__ray_call__`` (this module is pickled by
value, so the actor needs no access to the tests)."""

import sys

import ray.cloudpickle


def peer_reads_fail_and_the_store_is_down(pool) -> None:
    """Every peer read of ``pool`` fails (the holder's memory cannot be mapped here) and its
    object store moves nothing: a batch that still arrives came over the pools' collective."""
    from raykv.errors import TransportError
    from raykv.transport import FALLBACK

    async def unmappable(*args, **kwargs):
        raise TransportError("cannot map the holder's memory (test)")

    class Down:
        name, direct = FALLBACK, False

        async def stream(self, *args, **kwargs):
            raise TransportError("object store down (test)")
            yield

    pool._store_before_faults = pool.fetch.transports[FALLBACK]
    pool.pairs._peer_fetch, pool.fetch.transports[FALLBACK] = unmappable, Down()


def restore(pool) -> None:
    from raykv.transport import FALLBACK

    del pool.pairs._peer_fetch  # the class's again
    pool.fetch.transports[FALLBACK] = pool._store_before_faults


def peer_failures(pool) -> int:
    return pool.metrics.tally["failures_transport_peer"]


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
