"""Per-tenant byte quotas of the CPU, disk and object tiers (issue 48, point 4; invariant 13).

A tenant is the key a request's blocks hash under (``raykv.blocks.hashing.tenant_key``: its
cache salt and LoRA adapter); the tier records it per entry from the store that created it.
A quota bounds the bytes a tenant's entries may hold in one model's arena on one node.
Quotas are configured by tenant *label* (``tenant_label``: 8 hex digits of the key, what
``raykv status`` and the ``raykv_tenant_*`` metrics show) or by cache *salt* (turned into
its label here, so the salt never reaches an environment variable or a metric), plus
``default`` for every tenant not listed. Untenanted traffic (no salt, no adapter) is the
tenant ``none``: it gets ``none``'s quota where one is listed, else the default, like any
other tenant. No quota for a tenant (none listed, no default): it is bounded by the tier's
capacity alone, as before.

The configuration travels as ``RAYKV_TENANT_QUOTAS`` in the node's environment (``raykv up
--tenant-quota NAME=SIZE``, the Helm chart's ``tenantQuotas``), read by the tier actor as
the disk tier's settings are: ``default=2147483648,none=1073741824,3f2a9c1d=536870912``
(sizes in bytes or as ``raykv up`` reads them: 2GiB).

The disk tier's quotas (``raykv.tiers.disk_tier``) are configured apart, in the same syntax:
``RAYKV_DISK_TENANT_QUOTAS`` (``raykv up --disk-tenant-quota NAME=SIZE``), each tenant's
bytes in one model's disk tier on one node; a disk is usually far larger than RAM, so the CPU
tier's quotas are not reused there.

The object tier's (``raykv.tiers.object_tier``) too: ``RAYKV_OBJECT_TENANT_QUOTAS`` (``raykv up
--object-tenant-quota NAME=SIZE``), each tenant's bytes in one model's objects in the bucket,
shared by every node and cluster that uploads to it (usage is listed from the bucket).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from raykv.blocks.hashing import TENANT_LABEL_CHARS, Tenant, tenant_key, tenant_label
from raykv.errors import ConfigError

QUOTAS_ENV = "RAYKV_TENANT_QUOTAS"
DISK_QUOTAS_ENV = "RAYKV_DISK_TENANT_QUOTAS"  # the disk tier's, in the same syntax
OBJECT_QUOTAS_ENV = "RAYKV_OBJECT_TENANT_QUOTAS"  # the object tier's, in the same syntax
DEFAULT = "default"  # the quota of every tenant not listed
NONE = tenant_label(None)  # untenanted traffic: "none"
SALT_PREFIX = "salt:"  # forces a name to be read as a salt (one that looks like a label)
_LABEL = re.compile(rf"[0-9a-f]{{{TENANT_LABEL_CHARS}}}")
_FIX = (
    "write NAME=SIZE, NAME a tenant label as raykv status shows it (8 hex digits), a cache "
    f"salt (salt:TEXT to force one), {NONE!r} (requests without a tenant) or {DEFAULT!r} "
    "(every tenant not listed), SIZE e.g. 2GiB, 512MiB or 4096"
)


@dataclass(frozen=True)
class TenantQuotas:
    """Byte quotas per tenant label (``by_label``), and ``default`` for the rest (None: no
    quota for them)."""

    by_label: Mapping[str, int] = field(default_factory=dict)
    default: int | None = None

    def of(self, tenant: Tenant) -> int | None:
        """``tenant``'s quota in bytes (None: none)."""
        return self.by_label.get(tenant_label(tenant), self.default)

    def of_label(self, label: str) -> int | None:
        return self.by_label.get(label, self.default)

    def to_env(self) -> str:
        """``RAYKV_TENANT_QUOTAS``' value: labels only (a salt never leaves this process)."""
        items = ([(DEFAULT, self.default)] if self.default is not None else []) + sorted(
            self.by_label.items()
        )
        return ",".join(f"{name}={n}" for name, n in items)

    def as_dict(self) -> dict[str, int]:
        """The quotas by label, the default as ``default`` (stats, ``raykv status``)."""
        return ({DEFAULT: self.default} if self.default is not None else {}) | dict(self.by_label)


def quota_label(name: str) -> str:
    """The label a quota's NAME stands for: ``default`` and ``none`` as they are, a label (8
    lowercase hex digits) as it is, ``salt:TEXT`` or any other text as that cache salt's
    tenant (``tenant_label(tenant_key(salt))``; a tenant with a LoRA adapter is named by its
    label)."""
    if name in (DEFAULT, NONE) or _LABEL.fullmatch(name):
        return name
    salt = name.removeprefix(SALT_PREFIX)
    if not salt:
        raise ConfigError(f"tenant quota name {name!r} is empty; {_FIX}")
    return tenant_label(tenant_key(salt))


def parse_tenant_quotas(items: Iterable[str], source: str = "--tenant-quota") -> TenantQuotas:
    """``TenantQuotas`` of ``NAME=SIZE`` items (``quota_label`` reads NAME, ``parse_size``
    SIZE); ``source`` names where they came from in the errors. A name given twice with two
    sizes, a size that does not read or is negative: ``ConfigError`` naming it and the fix."""
    from raykv.layout.report import parse_size

    quotas: dict[str, int] = {}
    named: dict[str, str] = {}
    for item in items:
        name, eq, size = item.strip().partition("=")
        name, size = name.strip(), size.strip()
        if not eq or not name or not size:
            raise ConfigError(f"{source} {item!r}: {_FIX}")
        try:
            nbytes = parse_size(size)
        except ConfigError as e:
            raise ConfigError(f"{source} {item!r}: {e}") from None
        if nbytes < 0:
            raise ConfigError(f"{source} {item!r}: a quota of {nbytes} bytes; {_FIX}")
        label = quota_label(name)
        if label in quotas and quotas[label] != nbytes:
            raise ConfigError(
                f"{source}: {named[label]!r} and {name!r} both name tenant {label} with "
                f"quotas of {quotas[label]} and {nbytes} bytes; give it one quota"
            )
        quotas[label], named[label] = nbytes, name
    default = quotas.pop(DEFAULT, None)
    return TenantQuotas(quotas, default)


def tenant_quotas(
    environ: Mapping[str, str] | None = None, name: str = QUOTAS_ENV
) -> TenantQuotas | None:
    """The node's quotas from the variable ``name`` (comma-separated ``NAME=SIZE``): the
    CPU tier's ``RAYKV_TENANT_QUOTAS``, the disk tier's ``RAYKV_DISK_TENANT_QUOTAS`` or the
    object tier's ``RAYKV_OBJECT_TENANT_QUOTAS``; None where it is unset or empty (no
    quotas)."""
    text = (os.environ if environ is None else environ).get(name, "").strip()
    if not text:
        return None
    return parse_tenant_quotas([t for t in text.split(",") if t.strip()], name)
