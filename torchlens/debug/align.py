"""Pairing the ops of two traces in order, on the graph coordinates both share.

Every input source and op has graph coordinates: the module it ran in, its op name, and its
occurrence of that (module, op) pair in the trace. Ops are matched in order on (module, op) with a
longest-common-subsequence alignment (`difflib.SequenceMatcher`), so an op inserted into one
version, or missing from it, leaves every other op paired with its counterpart. Occurrence numbers
are not part of the matching key on purpose: an extra `mul` in a module renumbers every later `mul`
there, and keying on the numbers would mis-pair all of them.
"""

from __future__ import annotations

import difflib
from typing import Dict, List, Optional, Sequence, Tuple

from ..events import Event

__all__ = ["align", "align_on", "full_key", "name_key", "reference_pairs", "shape_key"]


def align(ops_a: Sequence[Event], ops_b: Sequence[Event]) -> List[Tuple[Optional[Event], Optional[Event]]]:
    """Pair the ops of two traces in order: (a, b) when matched, (a, None) / (None, b) otherwise.

    Ops are matched on everything the two sides share: module, op name and each output's shape
    and dtype. What that leaves unmatched is matched again on module, op and shapes (a run in
    another precision: its bf16 ops keep their shapes), then on module and op alone, so an op
    whose shape really changed still pairs with its twin (and is reported not comparable), but
    never in place of a twin that matches more: when one side has an extra `getitem`, its
    same-named neighbour is not paired with the wrong one.
    """
    return align_on(list(ops_a), list(ops_b), (full_key, shape_key, name_key))


def full_key(event: Event) -> tuple:
    return (event.module, event.op, tuple((tuple(meta.shape), meta.dtype) for meta in event.outputs))


def name_key(event: Event) -> tuple:
    return (event.module, event.op)


def shape_key(event: Event) -> tuple:
    return (event.module, event.op, tuple(tuple(meta.shape) for meta in event.outputs))


def reference_pairs(ops: Sequence[Event], reference_ops: Sequence[Event]) -> Dict[int, Event]:
    """Each op's twin in the float64 reference run (ordinal -> its event), paired on module, op
    and output shapes (the reference computes in float64: dtype is no key)."""
    pairs = align_on(list(ops), list(reference_ops), (shape_key, name_key))
    return {op.ordinal: ref for op, ref in pairs if op is not None and ref is not None}


def align_on(ops_a: List[Event], ops_b: List[Event], key_functions) -> List[Tuple[Optional[Event], Optional[Event]]]:
    """Pair in order on the first key function; what it leaves unmatched, with the next ones.

    The common head and tail are paired directly, which makes the usual cases (identical
    structure, a few ops inserted or removed in one place) linear; only the part between goes
    through `difflib.SequenceMatcher`, with `autojunk=False` because difflib would otherwise treat
    any key that fills more than 1% of a long trace (every `view` in an attention module) as noise.
    """
    if not key_functions:
        return [(event, None) for event in ops_a] + [(None, event) for event in ops_b]
    key, rest = key_functions[0], key_functions[1:]
    keys_a, keys_b = [key(event) for event in ops_a], [key(event) for event in ops_b]
    head = _common_length(zip(keys_a, keys_b))
    tail = _common_length(zip(reversed(keys_a[head:]), reversed(keys_b[head:])))
    middle_a, middle_b = ops_a[head:len(ops_a) - tail], ops_b[head:len(ops_b) - tail]
    pairs: List[Tuple[Optional[Event], Optional[Event]]] = list(zip(ops_a[:head], ops_b[:head]))
    matcher = difflib.SequenceMatcher(None, keys_a[head:len(keys_a) - tail], keys_b[head:len(keys_b) - tail],
                                      autojunk=False)
    for tag, a_start, a_end, b_start, b_end in matcher.get_opcodes():
        if tag == "equal":
            pairs.extend(zip(middle_a[a_start:a_end], middle_b[b_start:b_end]))
        else:
            pairs.extend(align_on(middle_a[a_start:a_end], middle_b[b_start:b_end], rest))
    pairs.extend(zip(ops_a[len(ops_a) - tail:], ops_b[len(ops_b) - tail:]))
    return pairs


def _common_length(pairs) -> int:
    """How many leading pairs have equal members."""
    count = 0
    for left, right in pairs:
        if left != right:
            break
        count += 1
    return count

