"""Side-by-side figures that are only ever reported when both sides ran the same workload.

Every benchmark side (stock LMCache or KVShrink) returns a :class:`SideRun`: the figures it
measured plus the :class:`Workload` it *actually* consumed — fingerprints of the trace (token ids
or data bytes), of the model (checkpoint or KV layout) and the budget read back from the objects
it built. :func:`compare` is the only way to make a :class:`Comparison` and raises
:class:`IncomparableError` when the two workloads differ, naming what differs, or when a side did
not record its :class:`TierPolicy` (inclusive / exclusive tiers, L1 size, promotion); the report checks
each row again (:func:`check_rows`) so a hand-edited or merged JSON cannot slip one through.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from kvshrink.errors import KVShrinkError

STOCK = "stock LMCache"
OURS = "KVShrink"


class IncomparableError(KVShrinkError):
    """The two sides of a comparison did not run on the same trace, model and budget."""


def digest(*parts: Any) -> str:
    """A short stable hex digest of bytes, numpy arrays, strings or JSON-able values."""
    h = hashlib.sha256()
    for part in parts:
        if hasattr(part, "tobytes"):  # numpy arrays, torch tensors via .numpy()
            h.update(str(getattr(part, "dtype", "")).encode())
            h.update(str(getattr(part, "shape", "")).encode())
            h.update(part.tobytes())
        elif isinstance(part, (bytes, bytearray, memoryview)):
            h.update(bytes(part))
        elif isinstance(part, str):
            h.update(part.encode())
        else:
            h.update(json.dumps(part, sort_keys=True, default=str).encode())
        h.update(b"\x00")
    return h.hexdigest()[:16]


def trace_fingerprint(requests: Iterable[Any]) -> str:
    """Fingerprint of a request sequence: order, session, turn and every token id."""
    h = hashlib.sha256()
    count = 0
    for req in requests:
        ids = getattr(req, "token_ids", req)
        h.update(f"{getattr(req, 'session_id', '')}:{getattr(req, 'turn', '')}:".encode())
        h.update(_int_bytes(ids))
        count += 1
    return f"{count}req-{h.hexdigest()[:16]}"


def _int_bytes(ids: Any) -> bytes:
    import numpy as np

    return np.asarray(ids, dtype=np.int64).tobytes()


def model_fingerprint(checkpoint: Path) -> str:
    """Fingerprint of a Hugging Face checkpoint folder: config and every weight file's bytes."""
    h = hashlib.sha256()
    files = sorted(p for p in Path(checkpoint).iterdir() if p.suffix in {".json", ".safetensors"})
    if not files:
        raise IncomparableError(f"{checkpoint} holds no config or weights to fingerprint")
    for path in files:
        h.update(path.name.encode())
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Workload:
    """What both sides must share. ``budget`` is read back from what was built, not from flags."""

    trace: str
    model: str
    budget: Mapping[str, Any]

    @property
    def fingerprint(self) -> str:
        return digest(self.trace, self.model, dict(self.budget))

    def differences(self, other: "Workload") -> list[str]:
        out = []
        if self.trace != other.trace:
            out.append(f"trace {self.trace} != {other.trace}")
        if self.model != other.model:
            out.append(f"model {self.model} != {other.model}")
        if dict(self.budget) != dict(other.budget):
            out.append(f"budget {dict(self.budget)} != {dict(other.budget)}")
        return out


@dataclass(frozen=True)
class Budget:
    """A cache budget in MiB of DRAM and of SSD, identical for both sides of a comparison."""

    dram_mib: float
    ssd_mib: float

    @property
    def total_mib(self) -> float:
        return self.dram_mib + self.ssd_mib

    @property
    def total_gib(self) -> float:
        return self.total_mib / 1024

    def label(self) -> str:
        return f"{self.total_mib:.0f} MiB ({self.dram_mib:.0f} DRAM + {self.ssd_mib:.0f} SSD)"


@dataclass(frozen=True)
class TierPolicy:
    """How one side arranged its cache: recorded for every side, shown beside every row.

    Sides may differ here (that is what is compared); what may not happen is a figure whose
    arrangement nobody wrote down. ``tiers``: ``inclusive`` (every chunk in every tier),
    ``exclusive`` (a chunk in one tier; budgets add up), ``single`` or ``none`` (no cache);
    ``l1_mib``: the engine's own hot cache in front (LMCache's L1 / LocalCPUBackend) that holds
    chunks; ``promotion``: whether a hit below moves or copies the chunk up; ``name``: the
    configuration's label (for stock: which of its sensible configurations this is)."""

    name: str
    tiers: str
    l1_mib: float
    promotion: bool

    KINDS = ("inclusive", "exclusive", "single", "none")

    def __post_init__(self) -> None:
        if self.tiers not in self.KINDS:
            raise IncomparableError(f"tier policy {self.name!r}: tiers must be one of {self.KINDS}, got {self.tiers!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "tiers": self.tiers, "l1_mib": self.l1_mib, "promotion": self.promotion}


NO_CACHE = TierPolicy("no cache (codec only)", "none", 0.0, False)


@dataclass
class SideRun:
    """One side's figures on one workload, with the tier policy it ran under."""

    side: str
    workload: Workload
    figures: dict[str, float]
    details: dict[str, Any] = field(default_factory=dict)
    policy: TierPolicy | None = None


@dataclass(frozen=True)
class Metric:
    """How to read a figure: its unit and which direction is better."""

    name: str
    unit: str
    higher_is_better: bool = True


@dataclass(frozen=True)
class Comparison:
    """One table row: the same metric on both sides of one workload."""

    section: str
    case: str  # e.g. "budget 1.5 GB" or "4K tokens, warm DRAM"
    metric: str
    unit: str
    higher_is_better: bool
    stock: float
    ours: float
    stock_fingerprint: str
    ours_fingerprint: str
    stock_policy: dict[str, Any] = field(default_factory=dict)
    ours_policy: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """ours / stock (inf when stock is 0 and ours is not; nan when both are 0)."""
        if self.stock == 0:
            return math.nan if self.ours == 0 else math.inf
        return self.ours / self.stock

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": _json_float(self.ratio)}


def compare(section: str, case: str, stock: SideRun, ours: SideRun, metrics: Sequence[Metric]) -> list[Comparison]:
    """Rows for ``metrics``; refuses (IncomparableError) unless both sides ran the same workload."""
    if stock.side != STOCK or ours.side != OURS:
        raise IncomparableError(f"{section}/{case}: expected sides ({STOCK!r}, {OURS!r}), got "
                                f"({stock.side!r}, {ours.side!r})")
    unrecorded = [s.side for s in (stock, ours) if s.policy is None]
    if unrecorded:
        raise IncomparableError(f"{section}/{case}: refusing to compare: no tier policy recorded for "
                                f"{', '.join(unrecorded)}")
    diff = stock.workload.differences(ours.workload)
    if diff:
        raise IncomparableError(f"{section}/{case}: refusing to compare runs on different workloads: "
                                + "; ".join(diff))
    rows = []
    for metric in metrics:
        missing = [s.side for s in (stock, ours) if metric.name not in s.figures]
        if missing:
            raise IncomparableError(f"{section}/{case}: {metric.name!r} was not measured by {', '.join(missing)}")
        rows.append(Comparison(section, case, metric.name, metric.unit, metric.higher_is_better,
                               float(stock.figures[metric.name]), float(ours.figures[metric.name]),
                               stock.workload.fingerprint, ours.workload.fingerprint,
                               stock.policy.to_dict(), ours.policy.to_dict()))
    return rows


def check_rows(rows: Iterable[Mapping[str, Any]]) -> None:
    """Re-check serialized rows before they are shown: both fingerprints present and equal, both
    tier policies recorded."""
    for row in rows:
        where = f"{row.get('section')}/{row.get('case')}/{row.get('metric')}"
        a, b = row.get("stock_fingerprint"), row.get("ours_fingerprint")
        if not a or a != b:
            raise IncomparableError(f"{where}: the two sides ran different workloads ({a} vs {b}); not reporting it")
        for side in ("stock_policy", "ours_policy"):
            policy = row.get(side) or {}
            if not {"name", "tiers", "l1_mib", "promotion"} <= set(policy):
                raise IncomparableError(f"{where}: {side} is not recorded ({policy!r}); not reporting it")


def _json_float(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)
