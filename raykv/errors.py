"""raykv's exception hierarchy: every message names the numbers involved and the fix."""

from __future__ import annotations


class RaykvError(Exception):
    """Base of every error raykv raises on purpose."""


class ConfigError(RaykvError, ValueError):
    """A layout, plan or deployment setting that cannot work (invariant 11)."""


class PageSizeError(ConfigError):
    """Page sizes of a hybrid model that cannot be unified."""


class BlockSizeError(ConfigError):
    """A block size that does not line up with the hash or kernel block size."""


class InsufficientMemoryError(ConfigError):
    """Too little memory to hold even one request of max_model_len tokens.

    ``need_bytes``: the pool bytes one request needs; ``fits_len``: the longest
    max_model_len the given bytes hold (0: none), so callers can word their own fix."""

    def __init__(self, message: str, *, need_bytes: int = 0, fits_len: int = 0) -> None:
        super().__init__(message)
        self.need_bytes, self.fits_len = need_bytes, fits_len


class RequestTooLarge(RaykvError, ValueError):
    """A request that can never fit an empty pool (invariant 2)."""


class UnknownRequest(RaykvError, KeyError):
    """A request id the block manager has not admitted."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown request"


class InvalidInput(RaykvError, ValueError):
    """Bad input from a caller (wrong dtype, shape, token count...); nothing was changed."""


class AccessDenied(RaykvError, PermissionError):
    """A call on something that belongs to another client (a request it admitted), or an
    admin call without the admin path."""


class TierError(RaykvError):
    """A data-plane failure: a store or load that could not complete."""


class TransportError(TierError):
    """A transport could not move a batch (peer unreachable, refused, timed out, died
    mid-transfer); the reader retries on the fallback transport or counts a miss."""


class ServiceError(RaykvError):
    """The Ray service is missing, unreachable or misconfigured."""


class ServiceGone(ServiceError):
    """The raykv service does not run on the joined Ray cluster (never started, or stopped):
    waiting does not bring it back, ``raykv up`` does."""
