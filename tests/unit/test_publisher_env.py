"""Where the trainer's live channels listen, from its environment: ``$POD_IP``, required in a pod."""

from __future__ import annotations

import logging

import pytest

from weightsync.errors import PermanentError
from weightsync_trainer import publisher

pytestmark = pytest.mark.unit


def test_a_pod_without_pod_ip_is_refused_naming_the_variable() -> None:
    with pytest.raises(PermanentError, match=r"\$POD_IP is not set in this pod.*status.podIP"):
        publisher.pod_ip({"KUBERNETES_SERVICE_HOST": "10.96.0.1"})


def test_outside_a_pod_loopback_is_offered_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=publisher.__name__):
        assert publisher.pod_ip({}) == "127.0.0.1"
    assert "$POD_IP is not set" in caplog.text and "only replicas on this host" in caplog.text


def test_pod_ip_is_offered_as_given() -> None:
    assert publisher.pod_ip({"POD_IP": "10.1.2.3", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}) == "10.1.2.3"
