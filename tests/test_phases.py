"""fedq.phases: what finalize's phase log line is made of."""

from __future__ import annotations

import re

from fedq.phases import current_times, phase, recording, summary


def test_phases_add_up_nest_and_cost_nothing_outside_a_record() -> None:
    # Prepare / Execute: a phase outside any record; then a record with a repeated
    # phase and an outer phase around two inner ones.
    with phase("outside"):
        pass
    assert current_times() == {}
    with recording() as times:
        with phase("open round"):
            pass
        with phase("updates"):
            for _ in range(2):
                with phase("read wait"):
                    pass
                with phase("decode"):
                    sum(range(20000))
        with phase("open round"):
            pass
        line = summary(current_times())
    # Assert: repeats add up; the outer phase is shown as its rest, in the order the
    # phases ended; nothing recorded outside; the record is closed afterwards.
    assert set(times) == {"open round", "updates", "read wait", "decode"}
    assert times["updates"] >= times["read wait"] + times["decode"]
    names = [m.group(1) for m in re.finditer(r"([a-z ()]+) [0-9.]+ ms", line)]
    assert [n.strip() for n in names] == ["open round", "read wait", "decode", "updates (rest)"]
    assert current_times() == {}
