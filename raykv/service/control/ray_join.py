"""Reaching Ray from any shell: which cluster to join, on which address, with which token.

Three things go wrong on a fresh machine unless raykv handles them itself:

* Ray swaps a loopback address for the host's routed address (``RAY_ENABLE_WINDOWS_OR_OSX_
  CLUSTER`` unset): a driver asked to join ``127.0.0.1:port`` dials ``192.0.2.2:port``, where
  nothing listens, and waits forever. A loopback cluster is joined on loopback.
* Ray remembers the last local cluster in ``ray_current_cluster`` in its temp folder and
  ``ray.init()`` joins it, dead or alive. raykv names every address it joins and checks it
  answers first; Ray's record is never used: with no address an embedded Ray starts.
* Ray's token auth: a head ``raykv up`` starts keeps it on; every raykv driver presents the
  token (``RAY_AUTH_TOKEN_PATH`` / ``~/.ray/auth_token``) unless the caller chose a mode.

Every wait here is bounded and ends in a ``ServiceError`` that says what to do.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import sys
from pathlib import Path
from typing import Any

from raykv.errors import ServiceError

LOOPBACK = "127.0.0.1"
JOIN_TIMEOUT_S = 30.0
_RAY_CLUSTERS = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

log = logging.getLogger(__name__)


def state_file() -> Path:
    """Where ``raykv up`` records the Ray head it started (address, pid, token path)."""
    return Path(os.environ.get("RAYKV_STATE", Path.home() / ".cache" / "raykv" / "up.json"))


def read_state() -> dict[str, Any]:
    try:
        state = json.loads(state_file().read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def token_path() -> Path:
    """The Ray auth token raykv uses: ``RAY_AUTH_TOKEN_PATH``, else Ray's default file."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def ensure_token(path: Path | None = None) -> Path:
    """The token file, created (random, owner-only) if it does not exist yet."""
    path = path or token_path()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path


def transport_secret_path(token: Path | None = None) -> Path:
    """Where ``raykv up`` keeps the transport secret: next to the Ray auth token."""
    return (token or token_path()).parent / "raykv_transport_secret"


def ensure_transport_secret(path: Path | None = None) -> str:
    """The transport secret UCX endpoints authenticate with (``raykv.transport.auth``),
    created (random, owner-only) if missing; the caller hands it to the nodes it starts
    as ``RAYKV_TRANSPORT_SECRET`` and never logs it."""
    path = path or transport_secret_path()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
    return path.read_text().strip()


def prepare_auth(*, create: bool = False) -> bool:
    """Before Ray is imported: make this process (and the Ray processes it starts) present
    Ray's token, so it can join a cluster with token auth on (``raykv up``'s head,
    ``cluster/local.sh``'s). A token sent to a cluster without auth is ignored there.

    The token is ``raykv up``'s (its state file) or ``token_path()``. The caller's own
    ``RAY_AUTH_MODE`` / ``RAY_AUTH_TOKEN`` win, and once Ray is imported nothing changes
    (Ray reads the mode at import; re-reading its config in a live process breaks its
    clusters): such a process sets ``RAY_AUTH_MODE=token`` itself. ``create``: make the
    token first if there is none (``raykv up`` starting a head). True if it was set."""
    if "ray" in sys.modules or os.environ.get("RAY_AUTH_MODE") or os.environ.get("RAY_AUTH_TOKEN"):
        return False
    recorded = read_state().get("token")
    path = Path(recorded) if recorded else token_path()
    if create:
        ensure_token(path)
    if not path.exists():
        return False
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)
    return True


def is_loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]") or address
    return host == "localhost" or host == "::1" or host.startswith("127.")


def stay_on_loopback() -> None:
    """Keep Ray on 127.0.0.1 in this process and the processes it starts.

    Ray reads the variable when it is imported and looks the flag up on every address it
    resolves, so both are set: an import of Ray before raykv's does not undo this."""
    os.environ[_RAY_CLUSTERS] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def listening(address: str, timeout_s: float = 1.0) -> bool:
    """Whether something accepts connections at ``host:port`` (a GCS that is up)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def local_address() -> str | None:
    """The Ray raykv uses on this host: ``RAY_ADDRESS``, else the head ``raykv up`` started, if
    it answers. Ray's own record of the last cluster (``ray_current_cluster``) is not used:
    it outlives the cluster, and joining a dead one waits forever."""
    env = os.environ.get("RAY_ADDRESS")
    if env and env not in ("auto", "local"):
        if not listening(env):
            raise ServiceError(
                f"RAY_ADDRESS={env} does not answer; start that cluster, or unset RAY_ADDRESS "
                "to use the one `raykv up` starts on this host"
            )
        return env
    address = read_state().get("address")
    return address if address and listening(address) else None


def join(address: str | None, namespace: str, *, start_local: bool) -> str:
    """``ray.init`` this process into ``address`` (None: ``local_address()``, else an embedded
    Ray on 127.0.0.1 when ``start_local``); returns the address joined ("local" if started).

    A loopback cluster is joined on loopback; an address that does not answer is an error
    within seconds, never a wait."""
    prepare_auth()
    import ray

    address = address or local_address()
    if address is None:
        if not start_local:
            recorded = read_state().get("address")
            also = f" ({state_file()} names {recorded}, which does not answer)" if recorded else ""
            raise ServiceError(
                f"raykv is not up on this host{also}; start it with `raykv up`, or pass "
                "--address of a running Ray cluster"
            )
        stay_on_loopback()
        # "local": never the cluster Ray recorded last (it did not answer above)
        ray.init(
            address="local",
            namespace=namespace,
            _node_ip_address=LOOPBACK,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
        return "local"
    if not listening(address, timeout_s=3.0):
        raise ServiceError(
            f"no Ray cluster answers at {address}; check the address (raykv status prints it) "
            "or start the service with `raykv up`"
        )
    node_ip = {}
    if is_loopback(address):
        stay_on_loopback()
        node_ip = {"_node_ip_address": LOOPBACK}
    try:
        ray.init(
            address=address,
            namespace=namespace,
            log_to_driver=False,
            logging_level=logging.WARNING,
            **node_ip,
        )
    except ConnectionError as e:
        raise ServiceError(f"could not join the Ray cluster at {address}: {_reason(e)}") from e
    return address


def _reason(error: BaseException) -> str:
    text = " ".join(str(c) for c in _chain(error))
    if "InvalidAuthToken" in text or "AuthenticationError" in text:
        return (
            "it refused this process (Ray token auth); put the cluster's token in "
            f"{token_path()} (or RAY_AUTH_TOKEN_PATH / RAY_AUTH_TOKEN), and where Ray was "
            "imported before raykv, export RAY_AUTH_MODE=token"
        )
    return f"{type(error).__name__}: {error}"


def _chain(error: BaseException | None):
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__
