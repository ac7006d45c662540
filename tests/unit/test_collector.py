"""The cyclic garbage collector held off while regions move (``channels.collector``): its state comes back after
the last of overlapping pauses. That ``regions.send`` and ``regions.receive`` run inside one:
``test_region_links.py``."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from weightsync.channels import collector

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_a_pause_turns_the_collector_off_and_back_to_what_it_was() -> None:
    with collector.paused():
        assert not gc.isenabled()
        with collector.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds
    assert gc.isenabled()
    gc.disable()
    with collector.paused():
        pass
    assert not gc.isenabled()  # off before: off after


def test_overlapping_pauses_on_threads_turn_it_on_after_the_last_leaves() -> None:
    entered, leave = threading.Barrier(3), threading.Event()

    def hold() -> None:
        with collector.paused():
            entered.wait()
            leave.wait()

    first = threading.Thread(target=hold)
    first.start()
    with collector.paused():
        second = threading.Thread(target=hold)
        second.start()
        entered.wait()
    assert not gc.isenabled()  # this thread left; the two others hold it
    leave.set()
    first.join()
    second.join()
    assert gc.isenabled()
