"""The admin path: calls that stop or reshape the whole service (``raykv down``) need the
service's admin key, which engine client handles never carry.

Ray's token is the security boundary (a driver holding it can run code on the cluster); the
admin key keeps an engine, or a script holding a client handle, from taking the service
down by accident. The first coordinator makes it and keeps it in Ray's internal KV (shared
by the cluster, kept across coordinator restarts); ``raykv down`` reads it from there.
"""

from __future__ import annotations

import secrets

from raykv.errors import AccessDenied
from raykv.service.served import NAMESPACE

_KEY = b"raykv-admin-key"


def admin_key() -> str:
    """The service's admin key, made on first use (needs a connected Ray)."""
    from ray.experimental import internal_kv

    key = internal_kv._internal_kv_get(_KEY, namespace=NAMESPACE)
    if key is None:  # first use: racing coordinators keep whichever key landed first
        new = secrets.token_hex(16).encode()
        internal_kv._internal_kv_put(_KEY, new, overwrite=False, namespace=NAMESPACE)
        key = internal_kv._internal_kv_get(_KEY, namespace=NAMESPACE)
    return key.decode()


def check_admin(given: str | None, expected: str, what: str) -> None:
    if not isinstance(given, str) or not secrets.compare_digest(given, expected):
        raise AccessDenied(
            f"{what} is an admin call: run `raykv down` (it reads the service's admin key "
            "from the cluster), not a client handle"
        )
