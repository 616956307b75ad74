"""Where two recorded op sequences part: ops matched by their place in the sequence, judged by content.

DebugMode's ``check_hash_mismatches`` compares two logs op for op and refuses two sequences of
different structure, and an eager and a traced arm always have different structure. The two
sequences are therefore aligned first.

difflib's ``SequenceMatcher`` first aligns the two sequences on everything an op shows: direction,
op, output shapes and output hashes. An aligned pair is an op both arms ran, in the same place,
with bit-identical outputs. Each op left unaligned is then one of:

* **elsewhere**: each of its outputs also occurs in the other arm (same dtype, shape and bits),
  only not here. A traced arm's scheduler may reorder chunks, or the other arm may make the same
  value with other ops (a graph's join ``add`` where eager autograd sums in place);
* **opaque**: nothing to compare (no tensor output, or a placeholder of no defined content);
* **divergent**: it has an output that the other arm never produced;
* **healed**: divergent, but the difference reaches nothing the run leaves behind (parameters,
  optimizer state): every path from it through divergent or opaque ops (a collective's placeholder
  passes a difference on to its wait) ends in a value both arms share, or
  in a host-side check. Eager ``one_hot`` checks its indices with ``aminmax`` and ``item``, and
  the traced graph checks them with ``ge``. Expert gradients summed in another order have
  differing partial sums but the same total. A difference seen only by the host (a loss that is
  reported but never trained on) therefore heals as well.

The arms part at their divergent ops. The first divergent ops of each arm are aligned again, on
structure alone (direction, op, output shapes). A pair is then the same op with different outputs
(**differs**); the other ops ran in one arm only. The first divergence is the first differing pair,
together with every one-sided op before it in either arm. A missing op, such as a gradient ``add``
that one arm lacks, comes before the first output it changes.

**Ambiguous** matching: the ops left unaligned before the first divergence (elsewhere, opaque or
healed). They are why the match is not op-for-op, and they are counted and located in the result.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Any

from harness.op_divergence.record import OpRecord

# How many divergent ops of each arm are aligned by structure. They start where the arms part, so
# the first differing pair lies among the first few; the rest are the consequences that follow.
DIVERGENT_SCAN = 512
CONTEXT = 5  # rows of the side-by-side window before and after the first divergence
LISTED = 10  # one-sided ops and unaligned spans listed in full; the rest only counted


@dataclass(frozen=True)
class Comparison:
    """Two op sequences matched: content-aligned pairs, each op's status, and where they part."""

    a: list[OpRecord]
    b: list[OpRecord]
    aligned: list[tuple[int, int]]  # (index in a, index in b), increasing in both
    gaps: list[tuple[int, int, int, int]]  # spans the alignment skipped: a[i1:i2] against b[j1:j2]
    status_a: list[str]  # per op: "same", "elsewhere", "opaque", "healed", "differs", "only", "divergent"
    status_b: list[str]
    pair: tuple[int, int] | None  # the first differing pair
    only_a: list[int]  # ops only a ran that differ from everything b made, before the first pair
    only_b: list[int]

    def first(self) -> tuple[int | None, int | None] | None:
        """Where the arms first part, as (index in a, index in b); None on the side with no op there."""
        events = [(self.anchor(i, None), 0, (i, None)) for i in self.only_a[:1]]
        events += [(self.anchor(None, j), 1, (None, j)) for j in self.only_b[:1]]
        if self.pair is not None:  # a one-sided op at the same anchor ran before the pair: it is listed before it
            events.append((self.anchor(*self.pair), 2, self.pair))
        return min(events)[2] if events else None

    def cuts(self) -> tuple[int, int]:
        """The positions in a and b where the first divergence begins (the lengths if none)."""
        first = self.first()
        if first is None:
            return len(self.a), len(self.b)
        i, j = first
        before = [p for p in self.aligned if (p[0] < i if i is not None else p[1] < j)]
        last_a, last_b = before[-1] if before else (-1, -1)
        return (i if i is not None else last_a + 1), (j if j is not None else last_b + 1)

    def anchor(self, i: int | None, j: int | None) -> int:
        """How many aligned pairs ran before this op (the earlier count of a pair's two ops)."""
        counts = []
        if i is not None:
            counts.append(bisect_left([p[0] for p in self.aligned], i))
        if j is not None:
            counts.append(bisect_left([p[1] for p in self.aligned], j))
        return min(counts)


def _content(r: OpRecord) -> tuple:
    return r.backward, r.op, r.outputs, r.hashes


def _structure(r: OpRecord) -> tuple:
    return r.backward, r.op, r.outputs


def _values(r: OpRecord) -> set[tuple[str, str]]:
    return {(out, h) for out, h in zip(r.outputs, r.hashes) if h is not None}


def _statuses(records: list[OpRecord], aligned: set[int], other: list[OpRecord]) -> list[str]:
    made = set().union(*map(_values, other))
    statuses = []
    for r in records:
        values = _values(r)
        if r.index in aligned:
            statuses.append("same")
        elif not values:
            statuses.append("opaque")
        else:
            statuses.append("elsewhere" if values <= made else "divergent")
    _mark_healed(records, statuses)
    return statuses


def _mark_healed(records: list[OpRecord], statuses: list[str]) -> None:
    """Divergent ops whose difference reaches no persisting output through divergent or opaque ops
    become "healed". An opaque op passes a difference on: a collective's output has no content when
    it is recorded (its wait's has), and FSDP reduce-scatters every gradient before the update."""
    readers: dict[int, list[int]] = {}
    for r in records:
        for source in r.inputs:
            readers.setdefault(source, []).append(r.index)
    live = [False] * len(records)
    for r in reversed(records):  # an op's readers run after it
        if statuses[r.index] == "divergent" or not _values(r):  # aligned or not, a placeholder shows nothing
            live[r.index] = r.persists or any(live[k] for k in readers.get(r.index, ()))
            if statuses[r.index] == "divergent" and not live[r.index]:
                statuses[r.index] = "healed"


def compare_ops(a: list[OpRecord], b: list[OpRecord]) -> Comparison:
    """Match two recorded sequences (indices must run 0, 1, ... as recorded) and find where they part.
    An arm that recorded no op is refused: "no divergence" must mean ops were compared."""
    for side, records in (("a", a), ("b", b)):
        if not records:
            raise ValueError(f"arm {side} recorded no op: nothing to compare (was the recorder on its thread?)")
    content = SequenceMatcher(None, [_content(r) for r in a], [_content(r) for r in b], autojunk=False)
    aligned = [(i + k, j + k) for i, j, n in content.get_matching_blocks() for k in range(n)]
    gaps = [(i1, i2, j1, j2) for tag, i1, i2, j1, j2 in content.get_opcodes() if tag != "equal"]
    status_a = _statuses(a, {i for i, _ in aligned}, b)
    status_b = _statuses(b, {j for _, j in aligned}, a)
    divergent_a = [i for i, s in enumerate(status_a) if s == "divergent"][:DIVERGENT_SCAN]
    divergent_b = [j for j, s in enumerate(status_b) if s == "divergent"][:DIVERGENT_SCAN]
    structure = SequenceMatcher(
        None, [_structure(a[i]) for i in divergent_a], [_structure(b[j]) for j in divergent_b], autojunk=False
    )
    pairs = [(divergent_a[x + k], divergent_b[y + k]) for x, y, n in structure.get_matching_blocks() for k in range(n)]
    pair = pairs[0] if pairs else None
    paired_a, paired_b = {i for i, _ in pairs}, {j for _, j in pairs}
    only_a = [i for i in divergent_a if i not in paired_a and (pair is None or i < pair[0])]
    only_b = [j for j in divergent_b if j not in paired_b and (pair is None or j < pair[1])]
    for statuses, pair_side, only in ((status_a, 0, only_a), (status_b, 1, only_b)):
        if pair is not None:
            statuses[pair[pair_side]] = "differs"
        for k in only:
            statuses[k] = "only"
    return Comparison(a, b, aligned, gaps, status_a, status_b, pair, only_a, only_b)


def describe(c: Comparison, *, context: int = CONTEXT) -> dict[str, Any]:
    """The comparison as plain JSON data.

    ``diverged`` and a one-line ``summary``; ``first_op``, the earliest op where the arms part
    (``kind`` "outputs differ", "only in a" or "only in b", with the op of each side or None);
    ``first_difference``, the first pair of one op with different outputs; ``only_in_a`` and
    ``only_in_b``, the one-sided ops before it; ``matching``, how the sequences were matched and how
    ambiguously; ``window``, rows of both sequences around ``first_op`` (the row marked ``first``).
    Ops appear as :meth:`OpRecord.describe` gives them, in the window in brief with their status.
    """
    first = c.first()
    cut_a, cut_b = c.cuts()
    result: dict[str, Any] = {
        "diverged": first is not None,
        "summary": _summary(c),
        "first_op": None,
        "first_difference": None,
        "only_in_a": [c.a[i].describe() for i in c.only_a[:LISTED]],
        "only_in_b": [c.b[j].describe() for j in c.only_b[:LISTED]],
        "matching": _matching(c, cut_a, cut_b),
        "window": _window(c, first, context) if first is not None else [],
    }
    if first is not None:
        i, j = first
        result["first_op"] = {
            "kind": "outputs differ" if None not in first else ("only in a" if j is None else "only in b"),
            "a": c.a[i].describe() if i is not None else None,
            "b": c.b[j].describe() if j is not None else None,
        }
    if c.pair is not None:
        result["first_difference"] = {"a": c.a[c.pair[0]].describe(), "b": c.b[c.pair[1]].describe()}
    return result


def _label(r: OpRecord) -> str:
    where = f"{'backward' if r.backward else 'forward'}{', ' + r.module if r.module else ''}"
    return f"{r.op} [{', '.join(r.outputs)}] at step {r.step} ({where})"


def _summary(c: Comparison) -> str:
    """One line for a report: where the arms part, or that they do not."""
    parts = [f"only in a: {_label(c.a[i])} (a#{i})" for i in c.only_a[:1]]
    parts += [f"only in b: {_label(c.b[j])} (b#{j})" for j in c.only_b[:1]]
    if c.pair is not None:
        i, j = c.pair
        parts.append(f"outputs differ: {_label(c.a[i])} (a#{i}, b#{j})")
    if not parts:
        return (
            f"no divergence: {len(c.aligned)} ops aligned with identical outputs;"
            " the rest occur elsewhere, carry no content or heal"
        )
    return "; then ".join(parts)


def _matching(c: Comparison, cut_a: int, cut_b: int) -> dict[str, Any]:
    """How the sequences were matched, and how ambiguously up to the first divergence."""
    unaligned = {
        side: dict(Counter(s for s in statuses if s != "same"))
        for side, statuses in (("a", c.status_a), ("b", c.status_b))
    }
    ambiguous = {
        "a": sum(s in ("elsewhere", "opaque", "healed") for s in c.status_a[:cut_a]),
        "b": sum(s in ("elsewhere", "opaque", "healed") for s in c.status_b[:cut_b]),
    }
    spans = [g for g in c.gaps if g[0] < cut_a or g[2] < cut_b]
    scope = "in the whole run" if c.first() is None else "before the first divergence"
    note = (
        f"matched op for op {scope}"
        if not spans
        else f"{len(spans)} unaligned spans {scope} hold {ambiguous['a']} ops of a and {ambiguous['b']} of b"
        " whose outputs occur elsewhere in the other arm, carry no content, or differ without reaching the"
        " arm's state"
    )
    return {
        "method": "difflib.SequenceMatcher on (direction, op, output shapes, output hashes); divergent ops"
        " re-aligned on (direction, op, output shapes)",
        "ops": {"a": len(c.a), "b": len(c.b)},
        "aligned": len(c.aligned),
        "unaligned": unaligned,
        "ambiguous": ambiguous,
        "spans": len(spans),
        "where": [_span(c, *g) for g in spans[:LISTED]],
        "note": note,
    }


def _span(c: Comparison, i1: int, i2: int, j1: int, j2: int) -> dict[str, Any]:
    def ops(records: list[OpRecord], lo: int, hi: int) -> list[str]:
        names = [r.op for r in records[lo : min(hi, lo + 3)]]
        return names + ([f"... {hi - lo - 3} more"] if hi - lo > 3 else [])

    return {"a": [i1, i2], "b": [j1, j2], "a_ops": ops(c.a, i1, i2), "b_ops": ops(c.b, j1, j2)}


def _side(r: OpRecord, status: str) -> dict[str, Any]:
    return {
        "index": r.index,
        "op": r.op,
        "module": r.module,
        "backward": r.backward,
        "outputs": list(r.outputs),
        "status": status,
    }


def _window(c: Comparison, first: tuple[int | None, int | None], context: int) -> list[dict[str, Any]]:
    """Both sequences side by side around the first divergence: a row per aligned or differing pair,
    a half row per op that has no counterpart at this place."""
    partner_a = dict(c.aligned + ([c.pair] if c.pair else []))
    partner_b = {j: i for i, j in partner_a.items()}
    anchor = c.anchor(*first)
    i, j = c.aligned[anchor - context] if anchor >= context else (0, 0)
    rows: list[dict[str, Any]] = []
    hit: int | None = None
    while (i < len(c.a) or j < len(c.b)) and (hit is None or len(rows) <= hit + context):
        left, right = _next_row(c, partner_a, partner_b, i, j)
        rows.append({"a": left and _side(left, c.status_a[i]), "b": right and _side(right, c.status_b[j])})
        if hit is None and ((left and left.index == first[0]) or (right and right.index == first[1])):
            hit = len(rows) - 1
        i, j = i + (left is not None), j + (right is not None)
    rows[hit]["first"] = True
    return rows[max(0, hit - 2 * context) :]


def _next_row(
    c: Comparison, partner_a: dict[int, int], partner_b: dict[int, int], i: int, j: int
) -> tuple[OpRecord | None, OpRecord | None]:
    """The next row of the window from a[i] and b[j]: a pair, or one of them alone."""
    if i >= len(c.a) or j >= len(c.b):
        return (c.a[i] if i < len(c.a) else None), (c.b[j] if j < len(c.b) else None)
    pa, pb = partner_a.get(i), partner_b.get(j)
    if pa == j:
        return c.a[i], c.b[j]
    if pa is None or pa < j or (pb is not None and pb > i):  # a's op has no partner ahead, or both do (crossing)
        return c.a[i], None
    return None, c.b[j]
