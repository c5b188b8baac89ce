"""The narrator's pass state: a block fed from the cache leaves the narrator exactly as feeding its
events one by one would, whatever the options, so compiled narration (which replays cached blocks)
cannot drift from eager narration."""

from __future__ import annotations

import pytest
from models import tiny_gpt, tokens

import torchlens as tl
from torchlens.narration.narrator import Narrator, PassCounts
from torchlens.narration.sinks import ListSink
from torchlens.options import NarrationOptions

OPTION_SETS = [
    dict(),
    dict(depth=1),
    dict(depth=2, max_lines=30),
    dict(max_lines=7),
    dict(select=tl.in_module("blocks.1")),
    dict(select=tl.in_module("blocks.0"), depth=2, max_lines=12),
]


@pytest.fixture(scope="module")
def events():
    return tl.record(tiny_gpt(), tokens()).events


def _narrate(events, options, blocks):
    """Feed a pass's events three times over (one pass), either event by event or as blocks of
    `blocks` events through one shared cache; return the lines and the footer."""
    sink = ListSink()
    narrator = Narrator(NarrationOptions(**options), sink)
    narrator.begin_pass("pass 1")
    caches = {}
    for _ in range(3):
        for start in range(0, len(events), blocks or len(events)):
            chunk = events[start:start + blocks] if blocks else events
            if blocks:
                narrator.feed_block(chunk, caches.setdefault(start, {}))
            else:
                for event in chunk:
                    narrator.feed(event)
    narrator.end_pass(["extra"])
    return sink.lines


@pytest.mark.parametrize("options", OPTION_SETS, ids=lambda o: ",".join(sorted(o)) or "plain")
@pytest.mark.parametrize("blocks", [5, 17])
def test_block_cache_narrates_exactly_like_feeding_each_event(events, options, blocks):
    one_by_one = _narrate(events, options, None)
    cached = _narrate(events, options, blocks)
    assert cached == one_by_one
    assert one_by_one[-1].startswith("-- end: ")


def test_every_counter_is_part_of_the_snapshot_and_is_restored():
    counts = PassCounts()
    for value, name in enumerate(PassCounts.__slots__, start=1):
        if name in PassCounts._MAPPINGS:
            getattr(counts, name)[("scope", value)] = value
        else:
            setattr(counts, name, value)
    snapshot = counts.snapshot()
    hash(snapshot)  # a cache key
    restored = PassCounts.restored(snapshot)
    for name in PassCounts.__slots__:
        assert getattr(restored, name) == getattr(counts, name), name
    restored.folded[("other", 0)] = 1  # a restored mapping is a copy, not the cached one
    assert PassCounts.restored(snapshot).folded == counts.folded


def test_a_counter_changed_by_a_cached_block_changes_the_next_lookup(events):
    """Two different starting states must not share a cache entry: the same block fed after a
    `max_lines` limit was reached prints nothing more and counts its lines as suppressed."""
    sink = ListSink()
    narrator = Narrator(NarrationOptions(max_lines=len(events) + 3), sink)
    narrator.begin_pass()
    cache = {}
    narrator.feed_block(events, cache)
    narrator.feed_block(events, cache)
    assert len(cache) == 2
    assert narrator.counts.lines_suppressed == len(events) - 3


@pytest.mark.parametrize("options", OPTION_SETS[1:], ids=lambda o: ",".join(sorted(o)))
def test_a_later_pass_starting_from_another_state_is_not_served_the_first_pass_lines(events, options):
    """Pass 2 starts with a note (a counted line) the first pass did not have: with a line limit
    or folding, the same block must then narrate as it would event by event."""
    def narrate(cached: bool):
        sink = ListSink()
        narrator = Narrator(NarrationOptions(**{**options, "max_lines": options.get("max_lines", 40)}), sink)
        cache = {}
        for number, notes in ((1, ()), (2, ("a note",) * 3)):
            narrator.begin_pass(f"pass {number}")
            for text in notes:
                narrator.note(text)
            if cached:
                narrator.feed_block(events, cache)
            else:
                for event in events:
                    narrator.feed(event)
            narrator.end_pass()
        return sink.lines

    assert narrate(True) == narrate(False)
