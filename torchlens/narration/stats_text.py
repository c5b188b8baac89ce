"""The statistics segment of an op line (`min=0 max=2 mean=1 sd=1 finite`), and `str(stats)`.

`grammar.render_op` puts this text after a line's `|`; `Stats.__str__` returns it too, so a user
printing `event.stats` sees what the line shows. A leaf module (it imports nothing from torchlens)
so that the event model and the grammar can both use it without importing each other.
"""

from __future__ import annotations

__all__ = ["counts_text", "stats_text"]

_INF = float("inf")


def _is_group(stats) -> bool:
    """A `StatsGroup` (one `Stats` per output of a multi-output op)."""
    return hasattr(stats, "parts")


def fmt(value) -> str:
    """Compact numbers: 4 significant digits, no trailing noise (`0.08`, `-2.115`, `1.2e+06`)."""
    if isinstance(value, int):
        return str(value)
    if value != value:
        return "nan"
    if value in (_INF, -_INF):
        return "inf" if value > 0 else "-inf"
    if value == int(value) and abs(value) < 1e6:
        return str(int(value))
    return format(value, ".4g")


def counts_text(stats) -> str:
    """`nan=3 +inf=1`, `finite`, or what was not measured (a `Stats` or `StatsGroup`)."""
    if _is_group(stats):
        return " ; ".join(counts_text(part) for part in stats.parts)
    if stats.nan is None:
        return "finiteness not measured"
    parts = [f"{label}={count}" for label, count in (("nan", stats.nan), ("+inf", stats.posinf), ("-inf", stats.neginf))
             if count]
    return " ".join(parts) if parts else "finite"


def stats_text(stats) -> str:
    """The statistics segment of a line, evidence-qualified: `=` measured over every element, `~=`
    estimated from a sample (with its size); only what measured every element says `finite`."""
    if _is_group(stats):
        rendered = [stats_text(part) for part in stats.parts]
        return " ; ".join(rendered) if any(rendered) else ""
    if not stats.shown:
        return ""
    kind = stats.kind
    if kind == "na":
        return f"stats n/a ({stats.note})"
    if kind == "counts":
        return counts_text(stats)
    if kind == "bool":
        return f"true={stats.true}/{stats.numel if stats.numel is not None else '?'}"
    values = [(name, value) for name, value in (("min", stats.min), ("max", stats.max), ("mean", stats.mean),
                                                ("sd", stats.sd)) if value is not None]
    if kind == "sampled":
        text = " ".join(f"{name}~={fmt(value)}" for name, value in values) + f" sampled={stats.sampled}/{stats.numel}"
        if stats.note:
            text += f" {stats.note}"
        if stats.nan is not None:  # counted over every element by non-finite tracking
            text += f" {counts_text(stats)}"
        return text
    text = " ".join(f"{name}={fmt(value)}" for name, value in values)
    if stats.nan is not None:  # not for an integer tensor: always finite, nothing to count
        text = f"{text} {counts_text(stats)}" if text else counts_text(stats)
    return f"{text} {stats.note}" if stats.note else text
