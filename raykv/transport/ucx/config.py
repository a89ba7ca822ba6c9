"""UCX transport settings, read from the node's environment (the service config the Helm
chart and ``raykv up`` hand to every Ray node).

* ``RAYKV_UCX`` (default 1): 0 runs no UCX listener and fetches nothing over UCX.
* ``RAYKV_UCX_TLS`` (default: UCX's own choice): ``UCX_TLS`` of raykv's UCX context, e.g.
  ``tcp`` (tests), ``rc,sm,self`` (InfiniBand / RoCE), ``tcp,cuda_copy,cuda_ipc``.
* ``RAYKV_UCX_NET_DEVICES`` (default: UCX's own, every device): ``UCX_NET_DEVICES`` of
  raykv's UCX context, e.g. ``lo`` (tests: every UCX socket binds 127.0.0.1), ``eth0``,
  ``mlx5_0:1``. UCX binds its sockets to these devices' addresses only (raykv runs no
  sockaddr listener, so nothing binds the wildcard address).
* ``RAYKV_UCX_STRIPES`` (one per 4 cores of this host, 1 to 4: ``default_stripes``):
  endpoints per peer; a large batch is striped over them. Each runs on a UCX worker of its
  own at both ends (``UcxRuntime.worker``: a progress thread each), so a process runs this
  many UCX workers.
* ``RAYKV_UCX_STRIPE_MIN_BYTES`` (4 MiB): batches smaller than this use one endpoint.
* ``RAYKV_UCX_CHUNK_BYTES`` (32 MiB): a batch is exported and sent in chunks of about this
  size, the next chunk gathered while the previous one is on the wire. Each chunk costs a
  header, its receives posted and a round on the hashing threads whatever its size: 128 MiB
  of scattered rows over 4 endpoints moved 0.93-1.08 x raw ucxx in 32 or 48 MiB chunks
  against 0.78-0.94 x in 16 MiB ones (8 MiB 0.60-0.72 x, 64 MiB 0.94-1.10 x; 16-core H100,
  tcp, 2026-11-28, five alternating rounds); on the 2-core box 1.8-2.1 GB/s against 1.6-1.9.
* ``RAYKV_UCX_TIMEOUT_S`` (10): bound on connecting, the handshake, each control message.
* ``RAYKV_UCX_MIN_GBPS`` (0.05): a batch's rows must arrive at least this fast (a batch's
  timeout is ``timeout_s + bytes / rate``).
* ``UCX_TCP_TX_SEG_SIZE`` / ``UCX_TCP_RX_SEG_SIZE`` (UCX's own variables; raykv's default
  1 MiB each, ``raykv.transport.ucx.runtime.TCP_SEGMENTS``, where neither is set; a node that
  sets one gets UCX's default for the other): UCX's defaults (8 KiB / 64 KiB) held one tcp
  endpoint to ~1.1 GB/s on loopback.
* ``RAYKV_UCX_HOST`` (the node's IP, from Ray): the host shown next to a member's UCX
  endpoint (its worker address) in logs and errors.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from raykv.errors import ConfigError


@dataclass(frozen=True)
class UcxConfig:
    enabled: bool = True
    tls: str | None = None
    net_devices: str | None = None
    stripes: int = field(default_factory=lambda: default_stripes())
    stripe_min_bytes: int = 4 << 20
    chunk_bytes: int = 32 << 20
    timeout_s: float = 10.0
    min_gbps: float = 0.05
    host: str | None = None

    def __post_init__(self) -> None:
        if self.stripes < 1 or self.timeout_s <= 0 or self.min_gbps <= 0:
            raise ConfigError(
                f"UCX settings out of range: stripes={self.stripes} (>= 1), timeout_s="
                f"{self.timeout_s} (> 0), min_gbps={self.min_gbps} (> 0); fix RAYKV_UCX_*"
            )

    def transfer_timeout(self, nbytes: int) -> float:
        """Seconds a batch of ``nbytes`` may take before its peer counts as dead."""
        return self.timeout_s + nbytes / (self.min_gbps * 1e9)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> UcxConfig:
        e = os.environ if env is None else env
        try:
            numbers = dict(
                stripes=int(e.get("RAYKV_UCX_STRIPES") or default_stripes()),
                stripe_min_bytes=int(e.get("RAYKV_UCX_STRIPE_MIN_BYTES", cls.stripe_min_bytes)),
                chunk_bytes=int(e.get("RAYKV_UCX_CHUNK_BYTES", cls.chunk_bytes)),
                timeout_s=float(e.get("RAYKV_UCX_TIMEOUT_S", cls.timeout_s)),
                min_gbps=float(e.get("RAYKV_UCX_MIN_GBPS", cls.min_gbps)),
            )
        except ValueError as err:
            raise ConfigError(f"a RAYKV_UCX_* setting is not a number ({err}); fix it") from err
        return cls(
            enabled=e.get("RAYKV_UCX", "1") not in ("0", "false", "no", "off"),
            tls=e.get("RAYKV_UCX_TLS") or None,
            net_devices=e.get("RAYKV_UCX_NET_DEVICES") or None,
            host=e.get("RAYKV_UCX_HOST") or None,
            **numbers,
        )


def default_stripes() -> int:
    """Stripes (UCX workers) where ``RAYKV_UCX_STRIPES`` is not set: one per 4 cores this
    process may run on, 1 to 4. Each stripe's worker needs a core at each end for its socket
    copies: a 128 MiB tier pull over loopback tcp moved 2.1-2.8 GB/s with 4 stripes against
    1.7-2.1 before stripes had workers of their own (16-core H100 host), but on a 2-core box
    1.48-1.63 GB/s with 1 stripe, 1.34-1.41 with 2 and 1.26-1.29 with 4 (2026-11-27)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores // 4))
