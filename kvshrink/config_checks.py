"""The value checks every KVShrink configuration parser shares, written once.

Each check takes a value and the key it was found under (spelled the way the operator wrote it,
``tiers[1].capacity``) and returns the value, converted where the check says so, or raises
:class:`~kvshrink.errors.ConfigError` with that ``key`` and a ``reason`` a person can act on.
Nothing here knows a particular file's layout: store, serve-cache, index, LMCache adapter and
plugin parsers compose these. Pure functions: no state, any thread; ``load_yaml`` only reads.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from kvshrink.errors import ConfigError

MAX_WORKERS = 256  # a thread-count setting above this is a typo, not a plan


def load_yaml(path: "str | Path", key: str | None = None, *, text: str | None = None) -> dict[str, Any]:
    """The mapping a YAML file holds (``text``: parse that instead, named ``path`` in messages).

    An empty document is ``{}``. An unreadable file, bad YAML (the reason gives the file, line and
    column) or a document that is not a mapping raises ConfigError under ``key``, the setting that
    holds the path (None: the caller re-keys it)."""
    import yaml

    path = Path(path).expanduser()
    try:
        data = yaml.safe_load(path.read_text() if text is None else text)
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(key, f"{path} is not valid YAML{where}: {problem}") from exc
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(key, f"{path} must hold a mapping, not a {type(data).__name__}")
    return dict(data)


def child_key(where: str, name: Any) -> str:
    """``where.name``, or ``name`` at the top level (``where`` empty)."""
    return f"{where}.{name}" if where else str(name)


def reject_unknown(data: Iterable[Any], allowed: Collection[str], where: str = "") -> None:
    """Every key of ``data`` (a mapping, or the keys themselves) is in ``allowed``: a typo must not
    fall back to a default silently. The first unknown key (sorted) is reported as ``where.key``."""
    unknown = sorted(str(k) for k in data if k not in allowed)
    if unknown:
        raise ConfigError(child_key(where, unknown[0]), f"unknown key; expected one of {sorted(allowed)}")


def mapping_value(value: Any, key: str, allowed: Collection[str] | None = None) -> Mapping[str, Any]:
    """``value`` if it is a mapping (None: empty), whose keys are all in ``allowed`` when given."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"expected a mapping, got {type(value).__name__}")
    if allowed is not None:
        reject_unknown(value, allowed, key)
    return value


def bool_value(value: Any, key: str) -> bool:
    """Exactly ``true`` or ``false``: ``"yes"`` or ``1`` are refused, not guessed."""
    if not isinstance(value, bool):
        raise ConfigError(key, f"expected true or false, got {value!r}")
    return value


def int_value(value: Any, key: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer (not a bool, not a float) within the inclusive bounds given."""
    if (isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)):
        bounds = _bounds(minimum, maximum)
        raise ConfigError(key, f"expected an integer{' ' + bounds if bounds else ''}, got {value!r}")
    return value


def number_value(value: Any, key: str, minimum: float = 0.0, *, above: bool = False,
                 maximum: float | None = None) -> float:
    """A number >= ``minimum`` (> with ``above``) and <= ``maximum`` when given, as a float."""
    low_ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
        value > minimum if above else value >= minimum)
    if not low_ok or (maximum is not None and value > maximum):
        bound = f"{'>' if above else '>='} {minimum:g}" + (f" and <= {maximum:g}" if maximum is not None else "")
        raise ConfigError(key, f"expected a number {bound}, got {value!r}")
    return float(value)


def one_of(value: Any, choices: Collection[Any], key: str) -> Any:
    """``value`` if it is one of ``choices``."""
    if value not in choices:
        raise ConfigError(key, f"expected one of {list(choices)}, got {value!r}")
    return value


def workers_value(value: Any, key: str) -> int:
    """A thread count: an integer in 1..MAX_WORKERS."""
    return int_value(value, key, 1, MAX_WORKERS)


def port_value(value: Any, key: str) -> int:
    """A TCP port to bind: 1..65535."""
    return int_value(value, key, 1, 65535)


def _bounds(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"in [{minimum}, {maximum}]"
    if minimum is not None:
        return f">= {minimum}"
    return f"<= {maximum}" if maximum is not None else ""
