"""GpuKV: the paged KV tensors of one GPU (one TP rank), allocated from a Plan or adopted.

``GpuKV.allocate`` builds exactly the layout ``raykv.layout.plan`` documents: tensor ``t`` is
a byte tensor ``[num_gpu_blocks, tensor_page_bytes[t]]``, layer ``group.layer_names[t]`` of
every group lives in tensor ``t`` (hybrid groups share it; a block id belongs to one group at
a time), and logical block ``b`` owns row ``b`` of every tensor. So the allocated bytes are
``num_gpu_blocks * gpu_bytes_per_block`` (checked), and num_blocks is always the plan's
(invariant 6), never a tensor shape.

Inside a row each layer gets its kernel-facing typed view through strides:

* attention ``[2, num_kernel_blocks, kernel_block_size, kv_heads_per_rank, head_dim]``; kernel
  block ``b*k + j`` (k = block_size // kernel_block_size, invariant 7) starts at byte
  ``j * page / k`` of row ``b`` and holds its K then its V half (``[K0 V0 K1 V1 ..]``; with
  k = 1 or an unpadded page this is simply the first layer-page bytes of the row);
* MLA ``[num_kernel_blocks, kernel_block_size, kv_lora_rank + rope]``, same kernel stride;
* Mamba ``[num_blocks, *state_shape_per_rank]`` per state, one after the other in the row.

The copy engine never looks at those views: ``entries(group_id)`` is one raw
``[num_blocks, page]`` uint8 row view per tensor the group uses, padding included, so one
block of one layer is one contiguous segment and the CPU tier stores the real allocated
bytes (invariant 5). ``GpuKV.register`` adopts an engine's own tensors: K/V-outermost
attention caches (``layout="kv_outer"``, the kernel shape above; their entries are each
layer's K and V halves, ``ops.logical_view``), or block-outermost ones
(``layout="block_outer"``: dim 0 is the kernel block, and one block of one layer is one
contiguous page whatever its inner order, e.g. vLLM CPU's
``[num_blocks, kv_heads, block_size, 2 * head_dim]``; the entry is the tensor itself).
Bytes are copied as they lie, so engines sharing a model's entries must share its inner
layout (the vLLM integration names the model after it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from raykv import ops
from raykv.errors import ConfigError, InvalidInput
from raykv.layout.plan import KVGroup, Plan
from raykv.layout.specs import KVSpec, Mamba

LayerTensors = torch.Tensor | tuple[torch.Tensor, ...]  # Mamba layers hold several states
LAYOUTS = ("kv_outer", "block_outer")  # engine tensors ``GpuKV.register`` adopts


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"KV dtype {name!r} is not a torch dtype; use e.g. 'bfloat16'")
    return dtype


def layer_spec(plan: Plan, group: KVGroup, layer: str) -> KVSpec:
    return plan.layer_specs.get(layer, group.spec)


def kernel_shape(plan: Plan, group: KVGroup, spec: KVSpec) -> tuple[tuple[int, ...], ...]:
    """Expected shape(s) of one layer's tensor(s) as the attention kernel sees them."""
    if isinstance(spec, Mamba):
        shapes = spec.state_shapes_per_rank(plan.tp_size)
        return tuple((plan.num_gpu_blocks, *s) for s in shapes)
    nkb = plan.num_gpu_blocks * group.kernel_blocks_per_block
    kbs = group.kernel_block_size
    if spec.kind == "mla":
        return ((nkb, kbs, spec.kv_lora_rank + spec.qk_rope_head_dim),)
    return ((2, nkb, kbs, spec.kv_heads_per_rank(plan.tp_size), spec.head_dim),)


def tensor_pages(plan: Plan) -> tuple[int, ...]:
    """Row bytes of each tensor; derived from the groups for hand-built plans."""
    if plan.tensor_page_bytes:
        return tuple(plan.tensor_page_bytes)
    width = max(len(g.layer_names) for g in plan.groups)
    pages = []
    for t in range(width):
        users = [g for g in plan.groups if t < len(g.layer_names)]
        pages.append(
            max(
                g.layer_page_bytes[t]
                if t < len(g.layer_page_bytes)
                else layer_spec(plan, g, g.layer_names[t]).page_bytes(g.block_size, plan.tp_size)
                for g in users
            )
        )
    return tuple(pages)


def _block_major_view(raw: torch.Tensor, page: int, plan: Plan, g: KVGroup, spec: KVSpec):
    """Typed kernel-facing view(s) of one layer in ``raw`` rows; see the module docstring."""
    dtype = torch_dtype(spec.dtype)
    esize = dtype.itemsize
    k = g.kernel_blocks_per_block
    shapes = kernel_shape(plan, g, spec)
    if page % (k * esize):
        raise ConfigError(
            f"page of {page} bytes is not a multiple of {k} kernel blocks x {esize}-byte "
            f"elements; align the page size in the plan"
        )
    typed = raw.view(-1).view(dtype)
    if isinstance(spec, Mamba):
        views, offset = [], 0
        for shape in shapes:
            inner = torch.Size(shape[1:])
            strides = [page // esize, *torch.empty(inner, device="meta").stride()]
            views.append(typed.as_strided(shape, strides, offset))
            offset += inner.numel()
        return tuple(views)
    kblock = page // k // esize  # elements from one kernel block to the next
    (shape,) = shapes
    if spec.kind == "mla":
        return typed.as_strided(shape, (kblock, shape[2], 1))
    _, _, kbs, heads, hd = shape
    half = kbs * heads * hd
    return typed.as_strided(shape, (half, kblock, heads * hd, hd, 1))


def _check_blocks_contiguous(name: str, t: torch.Tensor) -> None:
    block = t[0] if t.shape[0] else t
    if not block.is_contiguous():
        raise InvalidInput(
            f"layer {name!r}: one block of shape {tuple(block.shape)} has strides "
            f"{block.stride()}; each block must be contiguous in memory for the paged copy"
        )


def _layer_entries(name: str, t: LayerTensors, spec: KVSpec, k: int) -> list[torch.Tensor]:
    """Logical-block entries of one layer's own tensor(s) (K and V halves split)."""
    if isinstance(t, tuple):
        for s in t:
            _check_blocks_contiguous(name, s)
        return list(t)
    halves = [t] if spec.kind == "mla" else [t[0], t[1]]
    out = []
    for h in halves:
        if k > 1 and h.stride(0) != h[0].numel():
            raise InvalidInput(
                f"layer {name!r}: kernel blocks of one logical block are not adjacent "
                f"(block stride {h.stride(0)} elements, block holds {h[0].numel()}); "
                "register tensors whose kernel blocks of a logical block are contiguous"
            )
        v = ops.logical_view(h, k)
        _check_blocks_contiguous(name, v)
        out.append(v)
    return out


class GpuKV:
    """Paged KV tensors of one rank. ``entries(group_id)`` feeds ``raykv.ops`` copies."""

    def __init__(
        self,
        plan: Plan,
        layers: dict[str, LayerTensors],
        entries: dict[int, list[torch.Tensor]],
        device: torch.device,
        total_bytes: int,
    ) -> None:
        self.plan = plan
        self.layers = layers
        self._entries = entries
        self.device = device
        self.total_bytes = total_bytes
        self.shared_specs: tuple = ()  # set by allocate(shared=True) / attach
        self.raw: tuple[torch.Tensor, ...] = ()
        self.export: Any = None  # a CUDA pool's PeerExport (allocate(shared=True))

    @property
    def num_blocks(self) -> int:
        return self.plan.num_gpu_blocks  # invariant 6: never a tensor shape

    @classmethod
    def allocate(
        cls,
        plan: Plan,
        device: str | torch.device = "cpu",
        *,
        shared: bool = False,
        exportable: bool = False,
    ) -> GpuKV:
        """The plan's tensors on ``device``. ``shared``: on CPU in ``/dev/shm``
        (``raykv.tiers.shm``; ``shared_specs`` maps them in other processes of the node); on
        CUDA torch tensors shared with torch's CUDA IPC (``share_handles``), or with
        ``exportable`` (and raykv's extension here) one allocation any process of the host
        maps for its own GPU (``raykv.tiers.peer_memory``: a peer pool reading blocks over
        NVLink, an engine)."""
        from raykv.tiers import peer_memory

        device = torch.device(device)
        nb = plan.num_gpu_blocks
        layers: dict[str, LayerTensors] = {}
        entries: dict[int, list[torch.Tensor]] = {g.group_id: [] for g in plan.groups}
        pages = tensor_pages(plan)
        total = 0
        specs = []
        export = None
        if shared and exportable and peer_memory.available(device):
            export = peer_memory.PeerExport([(nb, page) for page in pages], device)
        for t, page in enumerate(pages):
            if shared and device.type == "cpu":
                from raykv.tiers import shm

                raw, shared_spec = shm.create((nb, page), f"kv{t}")
                specs.append(shared_spec)
            elif export is not None:
                raw = export.tensors[t]
            else:
                raw = torch.zeros((nb, page), dtype=torch.uint8, device=device)
            total += raw.numel()
            for g in plan.groups:
                if t >= len(g.layer_names):
                    continue
                name = g.layer_names[t]
                spec = layer_spec(plan, g, name)
                need = spec.page_bytes(g.block_size, plan.tp_size)
                if need > page:
                    raise ConfigError(
                        f"layer {name!r} needs {need} bytes per block but tensor {t} rows "
                        f"hold {page}; the plan's tensor_page_bytes are too small"
                    )
                layers[name] = _block_major_view(raw, page, plan, g, spec)
                entries[g.group_id].append(raw)
        expected = nb * plan.gpu_bytes_per_block
        if total != expected:
            raise ConfigError(
                f"tensors of {pages} bytes per row x {nb} blocks = {total} bytes, but the "
                f"plan says gpu_bytes_per_block={plan.gpu_bytes_per_block} ({expected} bytes); "
                "the plan and GpuKV disagree on the tensor layout"
            )
        kv = cls(plan, layers, entries, device, total)
        kv.shared_specs = tuple(specs)
        kv.raw = tuple(dict.fromkeys(e for es in entries.values() for e in es))
        kv.export = export
        return kv

    @classmethod
    def attach(cls, plan: Plan, specs: Sequence) -> GpuKV:
        """Map the tensors another process of this node allocated with ``shared=True`` on
        CPU: the same layout, the same bytes (block ids are the owner's)."""
        from raykv.tiers import peer_memory

        kv = cls.of_raw(plan, peer_memory.open_tensors(list(specs), torch.device("cpu")))
        kv.shared_specs = tuple(specs)
        return kv

    @classmethod
    def of_raw(cls, plan: Plan, tensors: Sequence[torch.Tensor]) -> GpuKV:
        """The layout ``allocate`` builds, over raw ``[blocks, page]`` tensors made elsewhere."""
        entries = {g.group_id: [tensors[t] for t in range(len(g.layer_names))] for g in plan.groups}
        layers = {
            name: _block_major_view(tensors[t], tensors[t].shape[1], plan, g,
                                    layer_spec(plan, g, name))
            for g in plan.groups
            for t, name in enumerate(g.layer_names)
        }  # fmt: skip
        kv = cls(plan, layers, entries, tensors[0].device, sum(t.numel() for t in tensors))
        kv.raw = tuple(tensors)
        return kv

    def share_handles(self) -> Any:  # pragma: no cover - GPU only
        """What another process of the host needs to open the raw tensors (``open_handles``):
        the ``PeerSpec`` of an exportable pool, else torch's CUDA IPC handles."""
        if self.export is not None:
            return self.export.spec
        from torch.multiprocessing.reductions import reduce_tensor

        return [reduce_tensor(t) for t in self.raw]

    @classmethod
    def open_handles(cls, plan: Plan, handles: Any) -> GpuKV:
        """The tensors another process of the host shares, opened in this process: a CPU
        pool's ``SharedSpec``s (``attach``), a CUDA pool's ``PeerSpec`` (mapped for this
        process's current GPU) or torch's CUDA IPC handles: the same layout and bytes (block
        ids are the owner's)."""
        from raykv.tiers import peer_memory, shm

        if handles and isinstance(handles, list) and isinstance(handles[0], shm.SharedSpec):
            return cls.attach(plan, handles)
        if isinstance(handles, peer_memory.PeerSpec):
            device = torch.device("cuda", torch.cuda.current_device())
            return cls.of_raw(plan, peer_memory.open_tensors(handles, device))
        return cls.of_raw(plan, [fn(*args) for fn, args in handles])

    @classmethod
    def register(
        cls,
        plan: Plan,
        tensors: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
        layout: str = "kv_outer",
    ):
        """Adopt an engine's tensors, checking shape, dtype, device and block count.
        ``layout``: "kv_outer" (attention tensors in the kernel shape) or "block_outer"
        (dim 0 the kernel block, each block one contiguous page); see the module docstring."""
        if layout not in LAYOUTS:
            raise InvalidInput(f"unknown KV tensor layout {layout!r}; use one of {LAYOUTS}")
        want = {n for g in plan.groups for n in g.layer_names}
        missing, extra = sorted(want - set(tensors)), sorted(set(tensors) - want)
        if missing or extra:
            raise InvalidInput(
                f"tensors do not match the plan's layers: missing {missing}, unexpected "
                f"{extra}; pass one entry per layer of the plan"
            )
        layers: dict[str, LayerTensors] = {}
        entries: dict[int, list[torch.Tensor]] = {g.group_id: [] for g in plan.groups}
        devices: set[torch.device] = set()
        storages: dict[int, int] = {}
        for g in plan.groups:
            for name in g.layer_names:
                spec = layer_spec(plan, g, name)
                given = tensors[name]
                ts = tuple(given) if isinstance(given, Sequence) else (given,)
                shapes = kernel_shape(plan, g, spec)
                if len(ts) != len(shapes):
                    raise InvalidInput(
                        f"layer {name!r}: expected {len(shapes)} tensor(s), got {len(ts)}"
                    )
                dtype = torch_dtype(spec.dtype)
                k = g.kernel_blocks_per_block
                outer = layout == "block_outer" and not isinstance(spec, Mamba)
                for t, shape in zip(ts, shapes, strict=True):
                    if outer:
                        page = spec.page_bytes(g.block_size, plan.tp_size) // k
                        _validate_block_outer(
                            name,
                            t,
                            shape[-4 if len(shape) == 5 else 0],
                            page,
                            dtype,
                            plan.num_gpu_blocks,
                        )
                    else:
                        _validate(name, t, shape, dtype, plan.num_gpu_blocks)
                    devices.add(t.device)
                    st = t.untyped_storage()
                    storages[st.data_ptr()] = st.nbytes()
                value: LayerTensors = ts if isinstance(spec, Mamba) else ts[0]
                layers[name] = value
                if outer:
                    entries[g.group_id].append(_outer_entry(name, ts[0], k))
                else:
                    entries[g.group_id] += _layer_entries(name, value, spec, k)
        if len(devices) > 1:
            raise InvalidInput(f"KV tensors live on several devices {sorted(map(str, devices))}")
        for gid, es in entries.items():
            if ops.row_bytes(es) > plan.gpu_bytes_per_block:
                raise InvalidInput(
                    f"group {gid} holds {ops.row_bytes(es)} bytes per block but the plan "
                    f"sizes gpu_bytes_per_block={plan.gpu_bytes_per_block}; plan and tensors "
                    "disagree"
                )
        device = devices.pop() if devices else torch.device("cpu")
        return cls(plan, layers, entries, device, sum(storages.values()))

    def entries(self, group_id: int) -> list[torch.Tensor]:
        """Views whose dim 0 is the LOGICAL block id of ``group_id`` (for raykv.ops)."""
        return self._entries[group_id]

    def row_bytes(self, group_id: int) -> int:
        return ops.row_bytes(self._entries[group_id])

    def kernel_view(self, layer: str) -> LayerTensors:
        """The layer's tensor(s) with dim 0 (attention: dim 1) in KERNEL block ids."""
        return self.layers[layer]


def _outer_entry(name: str, t: torch.Tensor, k: int) -> torch.Tensor:
    """The logical-block entry of a block-outermost layer tensor."""
    v = ops.logical_view(t, k)
    _check_blocks_contiguous(name, v)
    return v


def _validate_block_outer(
    name: str, t: torch.Tensor, kernel_blocks: int, page: int, dtype, num_blocks: int
) -> None:
    """A block-outermost tensor: ``kernel_blocks`` pages of ``page`` bytes along dim 0."""
    if not isinstance(t, torch.Tensor):
        raise InvalidInput(f"layer {name!r}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise InvalidInput(f"layer {name!r}: dtype expected {dtype}, got {t.dtype}")
    got = t[0].numel() * t.element_size() if t.dim() and t.shape[0] else 0
    if t.dim() < 2 or t.shape[0] != kernel_blocks or got != page:
        raise InvalidInput(
            f"layer {name!r}: block-outer tensor of shape {tuple(t.shape)} should hold "
            f"{kernel_blocks} kernel blocks of {page} bytes along dim 0 (plan: "
            f"num_gpu_blocks={num_blocks}); it holds {t.shape[0] if t.dim() else 0} of {got} "
            "bytes: serve the model with the engine's block size, heads, head size and dtype, "
            "and pass the engine's block count"
        )


def _validate(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype, num_blocks: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidInput(f"layer {name!r}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise InvalidInput(f"layer {name!r}: dtype expected {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        block_dim = 1 if len(shape) == 5 else 0
        hint = ""
        if t.dim() == len(shape) and t.shape[block_dim] != shape[block_dim]:
            hint = (
                f"; block dim holds {t.shape[block_dim]} blocks but the plan has "
                f"num_gpu_blocks={num_blocks} ({shape[block_dim]} kernel blocks)"
            )
        raise InvalidInput(
            f"layer {name!r}: shape expected {tuple(shape)}, got {tuple(t.shape)}{hint}"
        )
