"""What the codec accepts and gives back: numpy arrays and torch tensors of fixed-width dtypes.

Everything in between works on one representation: a C-contiguous ``uint8`` array of shape
``[elements, itemsize]`` (the "byte rows"), a view of the caller's memory whenever possible. The
frame records the container kind (numpy or torch) and the dtype *name*, checked against the allow
lists below, so a hostile header can never make us build an arbitrary dtype.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvshrink.codec.errors import OutputMismatchError, UnsupportedArrayError

NUMPY = "numpy"
TORCH = "torch"
CONTAINERS = (NUMPY, TORCH)

# numpy dtypes travel as dtype.str: byte order, kind, width ("<u2", "|b1", ">f8", "<c16").
_NUMPY_DTYPE = re.compile(r"^[<>|](b1|i1|u1|i2|u2|f2|i4|u4|f4|i8|u8|f8|c8|c16)$")

# torch dtypes travel by name; all have a fixed width in bytes (sub-byte types are excluded).
TORCH_DTYPE_WIDTHS = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1,
    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "uint32": 4, "float32": 4, "complex32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "complex64": 8,
    "complex128": 16,
}


@dataclass(frozen=True)
class ArrayKind:
    """Container, dtype name and shape: all ``decode`` needs to rebuild the caller's array."""

    container: str
    dtype: str
    shape: tuple[int, ...]
    itemsize: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize


def dtype_width(container: str, dtype: str) -> int | None:
    """Width in bytes of an allowed dtype name, None if the name is not allowed."""
    if container == NUMPY:
        return np.dtype(dtype).itemsize if _NUMPY_DTYPE.match(dtype) else None
    if container == TORCH:
        return TORCH_DTYPE_WIDTHS.get(dtype)
    return None


def as_byte_rows(x: Any) -> tuple[ArrayKind, np.ndarray]:
    """``x`` described, and its bytes as ``uint8[elements, itemsize]`` (read-only view or a copy).

    Never writes to ``x``. Non-contiguous inputs are copied once; torch tensors on another device
    are copied to host memory.
    """
    if _is_torch_tensor(x):
        return _torch_rows(x)
    if isinstance(x, np.generic):
        x = np.asarray(x)
    if not isinstance(x, np.ndarray):
        raise UnsupportedArrayError(f"encode takes a numpy array or a torch tensor, not {type(x).__name__}")
    if not _NUMPY_DTYPE.match(x.dtype.str):
        raise UnsupportedArrayError(f"cannot encode numpy dtype {x.dtype!s} (supported: bool, ints, floats, complex)")
    kind = ArrayKind(NUMPY, x.dtype.str, tuple(int(d) for d in x.shape), x.dtype.itemsize)
    flat = np.ascontiguousarray(x).reshape(-1)
    rows = flat.view(np.uint8).reshape(kind.size, kind.itemsize)
    return kind, _read_only(rows)


def new_output(kind: ArrayKind) -> tuple[Any, np.ndarray]:
    """A fresh array/tensor for ``kind`` and its writable byte rows."""
    if kind.container == TORCH:
        torch = _import_torch()
        tensor = torch.empty(kind.shape, dtype=getattr(torch, kind.dtype))
        return tensor, _torch_storage_rows(tensor, kind.itemsize)
    array = np.empty(kind.shape, dtype=np.dtype(kind.dtype))
    return array, array.reshape(-1).view(np.uint8).reshape(kind.size, kind.itemsize)


def output_rows(out: Any, kind: ArrayKind) -> np.ndarray | None:
    """Writable byte rows straight into ``out``, or None when ``out`` must be filled by a copy.

    ``out`` must hold exactly as many bytes, and the same dtype as the frame, or be the raw bits of
    it (a ``uint16`` buffer for a bf16 frame, a bf16 buffer for a ``uint16`` frame, or plain
    ``uint8`` bytes); anything else raises
    :class:`OutputMismatchError` before a byte is written.
    """
    if _is_torch_tensor(out):
        name, itemsize = str(out.dtype).removeprefix("torch."), out.element_size()
        nbytes = out.numel() * itemsize
        direct = out.device.type == "cpu" and out.is_contiguous() and not out.requires_grad
    elif isinstance(out, np.ndarray):
        name, itemsize, nbytes = _numpy_name(out.dtype), out.dtype.itemsize, out.nbytes
        if not out.flags.writeable:
            raise OutputMismatchError("output array is read-only")
        direct = out.flags.c_contiguous
    else:
        raise OutputMismatchError(f"out must be a numpy array or a torch tensor, not {type(out).__name__}")
    want = _numpy_name(np.dtype(kind.dtype)) if kind.container == NUMPY else kind.dtype
    raw_bits = f"uint{8 * kind.itemsize}"  # either side being the raw-bits view of the other is fine
    same_width = itemsize == kind.itemsize and (name == want or raw_bits in (name, want))
    if nbytes != kind.nbytes or not (same_width or name == "uint8"):
        raise OutputMismatchError(
            f"output buffer is {name} with {nbytes} bytes; the frame holds {want} {list(kind.shape)} "
            f"({kind.nbytes} bytes); pass a buffer of that dtype (or its raw uint view) and size")
    if not direct or kind.nbytes == 0:
        return None
    if _is_torch_tensor(out):
        return _torch_storage_rows(out, kind.itemsize)
    return out.reshape(-1).view(np.uint8).reshape(kind.size, kind.itemsize)


def copy_into(out: Any, raw: np.ndarray) -> None:
    """Fill a non-contiguous (or non-CPU) ``out`` from the decoded bytes ``raw`` (flat ``uint8``)."""
    if _is_torch_tensor(out):
        torch = _import_torch()
        src = torch.from_numpy(raw).view(out.dtype).reshape(out.shape)
        with torch.no_grad():
            out.copy_(src)
        return
    np.copyto(out, raw.view(out.dtype).reshape(out.shape))


def _numpy_name(dtype: np.dtype) -> str:
    """'float32', 'bool', 'uint16'... for native byte order; the dtype string ('>f4') otherwise."""
    if dtype.byteorder == ">":
        return dtype.str
    return "bool" if dtype.kind == "b" else dtype.name


def _read_only(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


def _is_torch_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "element_size") and hasattr(x, "untyped_storage")


def _import_torch():
    try:
        import torch
    except ImportError as exc:  # only reachable for torch frames on a host without torch
        raise UnsupportedArrayError("this frame holds a torch tensor and torch is not installed; "
                                    "decode(..., as_numpy=True) returns its bytes as numpy") from exc
    return torch


def _torch_rows(x: Any) -> tuple[ArrayKind, np.ndarray]:
    torch = _import_torch()
    name = str(x.dtype).removeprefix("torch.")
    if name not in TORCH_DTYPE_WIDTHS:
        raise UnsupportedArrayError(f"cannot encode torch dtype {x.dtype} (no sub-byte or quantized types)")
    t = x.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    kind = ArrayKind(TORCH, name, tuple(int(d) for d in t.shape), t.element_size())
    if kind.size == 0:  # torch refuses dtype views of empty tensors
        return kind, _read_only(np.empty((0, kind.itemsize), dtype=np.uint8))
    rows = t.contiguous().reshape(-1).view(torch.uint8).numpy().reshape(kind.size, kind.itemsize)
    return kind, _read_only(rows)


def _torch_storage_rows(t: Any, itemsize: int) -> np.ndarray:
    torch = _import_torch()
    if t.numel() == 0:
        return np.empty((0, itemsize), dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy().reshape(-1, itemsize)
