"""The Python LocalSGD decides each step by the C++ schedule
(client/sync_schedule.h, through localsgd._localsgd.decide_step): its
documented table, row by row, the same rows as
tests/client/sync_schedule_test.cc; and LocalSGD.step() acts on it."""
import itertools

import pytest

from localsgd._localsgd import decide_step

# (overlap, node_group, due, in_flight, ready) -> action; None: any.
TABLE = [
    (False, None, False, None, None, "none"),
    (False, None, True, None, None, "sync"),
    (True, True, False, None, None, "none"),
    (True, True, True, None, None, "node_sync_point"),
    (True, False, False, False, None, "none"),
    (True, False, False, True, False, "none"),
    (True, False, False, True, True, "merge"),
    (True, False, True, False, None, "start"),
    (True, False, True, True, None, "merge_then_start"),
]


def expected(overlap, node_group, due, in_flight, ready):
    for row in TABLE:
        if all(want is None or want == got for want, got in
               zip(row[:5], (overlap, node_group, due, in_flight, ready))):
            return row[5]
    raise AssertionError("no row")


@pytest.mark.parametrize("k", [1, 4, 16])
def test_decide_step_follows_the_table(k):
    for overlap, node_group, due, in_flight, ready in itertools.product(
            [False, True], repeat=5):
        if not due and k == 1:
            continue
        steps = 3 * k if due else 3 * k + 1
        got = decide_step(steps, k, overlap, node_group, in_flight, ready)
        assert got == expected(overlap, node_group, due, in_flight, ready), \
            (k, overlap, node_group, due, in_flight, ready)


def test_a_budget_replaces_k_except_in_node_groups():
    # K = 16, budget 5: due once 5 steps were made since the last sync.
    assert decide_step(7, 16, False, False, False, False,
                       since_sync=4, budget=5) == "none"
    assert decide_step(8, 16, False, False, False, False,
                       since_sync=5, budget=5) == "sync"
    assert decide_step(16, 16, False, False, False, False,
                       since_sync=3, budget=5) == "none"
    assert decide_step(9, 16, True, False, False, False,
                       since_sync=6, budget=5) == "start"
    # Node groups sync in lockstep every K steps.
    assert decide_step(8, 16, True, True, False, False,
                       since_sync=5, budget=5) == "none"
    assert decide_step(16, 16, True, True, False, False,
                       since_sync=3, budget=5) == "node_sync_point"
    # No budget: every K.
    assert decide_step(16, 16, False, False, False, False,
                       since_sync=16, budget=0) == "sync"


def test_every_rows_action_is_named():
    assert {row[5] for row in TABLE} == {
        "none", "sync", "node_sync_point", "merge", "start",
        "merge_then_start"}


def test_k_below_one_is_refused():
    with pytest.raises(ValueError, match="local_sgd_steps must be >= 1"):
        decide_step(1, 0, False, False, False, False)
