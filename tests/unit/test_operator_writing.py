"""The operator's write lane: the status that answers a spec change goes out before waiting children's writes."""

from __future__ import annotations

import threading

import pytest

from weightsync_operator.writing import Lane, Urgency

pytestmark = pytest.mark.unit


def test_a_free_writer_takes_the_answers_to_a_spec_change_first_then_the_rest_in_turn() -> None:
    lane = Lane(width=1)
    busy, sent = threading.Event(), list[str]()
    first = lane.submit(Urgency.IN_TURN, busy.wait, 10)  # holds the only writer while the others queue
    queued = [
        lane.submit(urgency, sent.append, label)
        for urgency, label in (
            (Urgency.IN_TURN, "apply job-0"),
            (Urgency.IN_TURN, "status job-1 (pods going)"),
            (Urgency.IN_TURN, "delete job-0"),
            (Urgency.ANSWER, "status job-2 (suspended)"),
            (Urgency.ANSWER, "status job-3 (suspended)"),
        )
    ]
    busy.set()
    assert first.result(10) is True
    for future in queued:
        future.result(10)
    assert sent == [
        "status job-2 (suspended)",
        "status job-3 (suspended)",
        "apply job-0",
        "status job-1 (pods going)",
        "delete job-0",
    ]


def test_no_childs_write_starts_while_an_answer_is_being_written() -> None:
    lane = Lane(width=4)
    answering, started = threading.Event(), threading.Event()
    answer = lane.submit(Urgency.ANSWER, answering.wait, 10)
    child = lane.submit(Urgency.IN_TURN, started.set)
    assert not started.wait(0.3), "a child's write went out beside the answer"
    answering.set()
    assert answer.result(10) is True and started.wait(10)
    child.result(10)
    # with no answer out, children's writes go out together (the width)
    barrier = threading.Barrier(4, timeout=10)
    assert lane.each(Urgency.IN_TURN, lambda i: barrier.wait() >= 0 and i, [1, 2, 3, 4]) == [1, 2, 3, 4]


def test_writes_of_one_call_go_out_together_and_an_error_reaches_the_caller() -> None:
    lane = Lane(width=3)
    barrier = threading.Barrier(3, timeout=10)  # passes only if all three are in flight at once
    assert lane.each(Urgency.IN_TURN, lambda i: barrier.wait() >= 0 and i, [1, 2, 3]) == [1, 2, 3]

    def refuse(name: str) -> None:
        raise ValueError(f"{name} refused")

    with pytest.raises(ValueError, match="pod-a refused"):
        lane.run(Urgency.IN_TURN, refuse, "pod-a")
