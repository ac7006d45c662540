"""Fixtures the integration modules share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import hostfleet, support
from tests.integration import faulty_worker, servers


@pytest.fixture(scope="session")
def host_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[hostfleet.Fleet]:
    """The multi-host fleet (minutes to start), shared by ``test_fleet_hosts`` and the fault suite after it."""
    with hostfleet.running(tmp_path_factory.mktemp("fleet")) as fleet:
        yield fleet


@pytest.fixture(scope="session")
def served_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.Server]:
    """One served vLLM (its OpenAI server in dev mode, with the product's worker extension plus a test fault) and its
    proxy, shared by ``test_served_caches`` and ``test_served_engine`` (starting one costs a minute of CI's hour).
    Each module drives it with its own replica, volume and versions; each leaves it serving a whole version."""
    with servers.running(
        tmp_path_factory.mktemp("served"), support.tiny_model(), extension=faulty_worker.QUALNAME
    ) as s:
        yield s
