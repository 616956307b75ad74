"""The report's "First op where the arms part" section: a check's ``extra.first_op_divergence``
(harness/first_op.py) as the two op sequences side by side around the first difference."""

from __future__ import annotations

from typing import Any


def first_op_view(checks: list[dict]) -> dict[str, Any] | None:
    """The located check's facts and window rows, each row a pair of ops (or one, where the other arm
    has none there), the first difference marked; None where no check carries one."""
    check = next((c for c in checks if (c.get("extra") or {}).get("first_op_divergence")), None)
    if check is None:
        return None
    found = check["extra"]["first_op_divergence"]
    pair = found.get("first_difference") or {}
    shapes = pair.get("a", {}).get("outputs", [])
    return {
        "check": check["name"],
        "arms": found["arms"],
        "line": found["line"],
        "matching": (found.get("matching") or {}).get("note"),
        "ranks": found.get("ranks", []),
        "pair": f"{pair['a']['op']} a#{pair['a']['index']}, b#{pair['b']['index']}" if pair else None,
        "outputs": [{"shape": shape, **diff} for shape, diff in zip(shapes, pair.get("outputs", []))],
        "rows": [
            {"first": row.get("first", False), "a": _side(row["a"]), "b": _side(row["b"])}
            for row in found.get("window", [])
        ],
    }


def _side(op: dict | None) -> dict[str, str] | None:
    if op is None:
        return None
    return {
        "index": str(op["index"]),
        "op": op["op"],
        "where": f"{'backward' if op['backward'] else 'forward'}{', ' + op['module'] if op['module'] else ''}",
        "outputs": ", ".join(op["outputs"]),
        "status": op["status"],
    }
