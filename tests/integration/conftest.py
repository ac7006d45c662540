"""Fixtures the integration modules share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import hostfleet


@pytest.fixture(scope="session")
def host_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[hostfleet.Fleet]:
    """The multi-host fleet (minutes to start), shared by ``test_fleet_hosts`` and the fault suite after it."""
    with hostfleet.running(tmp_path_factory.mktemp("fleet")) as fleet:
        yield fleet
