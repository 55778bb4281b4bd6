"""LMCache ``MemoryObj`` buffers as the typed tensors our store and codec work on.

The codec splits each element into its bytes (bf16 high and low bytes compress very differently),
so it needs to know the element width: we hand it the object's typed view, not its raw bytes.
Both directions use the same view, so a load writes exactly the bytes a store read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from lmcache.v1.memory_management import MemoryObj


def chunk_tensor(obj: "MemoryObj") -> "torch.Tensor":
    """A CPU tensor over exactly the ``get_size()`` bytes of ``obj``, typed when the object is.

    Objects with one layout give their ``[2, layers, tokens, hidden]`` view; objects whose
    groups differ in dtype fall back to a flat uint8 view of the same bytes. No copy is made:
    writing into the result writes into ``obj``.
    """
    import torch

    size = obj.get_size()
    typed = obj.tensor
    if typed is not None and typed.numel() * typed.element_size() == size:
        return typed
    raw = obj.raw_tensor
    if raw is None:
        raise TypeError(f"{type(obj).__name__} has no tensor view; only tensor-backed MemoryObjs are supported")
    flat = raw.view(torch.uint8)[:size]
    dtypes = set(_dtypes(obj))
    if len(dtypes) == 1:
        (dtype,) = dtypes
        itemsize = torch.empty((), dtype=dtype).element_size()
        if size % itemsize == 0:
            return flat.view(dtype)
    return flat


def _dtypes(obj: "MemoryObj") -> list["torch.dtype"]:
    meta = obj.metadata
    if meta.dtypes:
        return list(meta.dtypes)
    return [meta.dtype] if meta.dtype is not None else []
