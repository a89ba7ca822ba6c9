"""The service's control calls for drivers below the client layer (``raykv up / status``):
start or find the coordinator, and call it with a bounded wait.

``raykv.client`` builds on these (``connect`` starts the service with ``ensure_service``);
nothing here imports the client, so the service layer depends only on layers below it.
"""

from __future__ import annotations

from typing import Any

import ray

from raykv.errors import RaykvError, ServiceError, ServiceGone
from raykv.service.served import COORDINATOR, NAMESPACE

START_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 10.0
# add_model plans, probes a GPU and places every node's pools: each step is bounded by the
# coordinator (PLACE_TIMEOUT_S); this bounds the whole call
ADD_MODEL_TIMEOUT_S = 600.0


def ensure_service(namespace: str = NAMESPACE) -> Any:
    """The coordinator actor, created (named, detached) if it does not exist yet."""
    from raykv.service.control.coordinator import coordinator_actor

    coord = coordinator_actor().remote() if namespace == NAMESPACE else None
    if coord is None:
        raise ServiceError(f"the service runs in namespace {NAMESPACE!r}, not {namespace!r}")
    try:
        ray.get(coord.ping.remote(), timeout=START_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise ServiceError(
            f"the raykv coordinator did not start within {START_TIMEOUT_S:.0f}s; does the "
            "cluster have a free CPU (raykv status, ray status)?"
        ) from None
    return coord


def coordinator(namespace: str = NAMESPACE) -> Any:
    """The running coordinator; ServiceGone if the service is not up."""
    try:
        return ray.get_actor(COORDINATOR, namespace=namespace)
    except ValueError:
        raise ServiceGone("Ray runs but the raykv service does not (raykv up)") from None


def call(coord: Any, method: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
    """``coord.method(*args)``, waited for at most ``timeout_s``: a raykv error raised by the
    method is raised here as it is; no answer (or a dead coordinator) is a ServiceError.
    Ray retries the call through a coordinator restart (its ``max_task_retries``)."""
    try:
        return ray.get(getattr(coord, method).remote(*args), timeout=timeout_s)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, RaykvError):
            raise e.cause from None
        raise
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as e:
        raise ServiceError(
            f"the raykv coordinator did not answer {method!r} within {timeout_s:.0f}s "
            f"({type(e).__name__}); check raykv status and ray status, then retry"
        ) from e
