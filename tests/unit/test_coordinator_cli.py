"""`weightsync coordinator`: help that reads well, secure by default, --status [--json] against a live server."""

from __future__ import annotations

import json

import pytest

from weightsync.cli import main as cli
from weightsync.coordinator import server
from weightsync.coordinator.client import CoordinatorClient
from weightsync.coordinator.models import Capabilities
from weightsync.vocabulary import Channel

pytestmark = pytest.mark.unit


def test_help_explains_security_and_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["coordinator", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for phrase in (
        "Secure by default",
        "--insecure",
        "--tls-client-ca",
        "--token-file",
        "WEIGHTSYNC_TOKEN",
        "--volume",
        "--metrics-port",
        "127.0.0.1",
        "examples:",
        "--status",
    ):
        assert phrase in out, phrase


def test_refuses_to_serve_without_tls_unless_insecure(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["coordinator", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "TLS is on by default: pass --tls-cert and --tls-key" in err and "--insecure" in err
    assert cli.main(["coordinator", "--port", "0", "--tls-cert", "x.crt"]) == 2
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err
    assert cli.main(["coordinator", "--insecure", "--port", "0", "--channel-preference", "ipc,carrier-pigeon"]) == 2
    assert "unknown channel 'carrier-pigeon'" in capsys.readouterr().err


def test_status_json(capsys: pytest.CaptureFixture[str]) -> None:
    s = server.CoordinatorServer(server.ServerConfig(insecure=True, port=0)).start()
    try:
        with CoordinatorClient(s.target, insecure=True) as c:
            c.register_replica("cli-job", "replica-0", Capabilities(channels=(Channel.CPU,)))
            port = s.target.rsplit(":", 1)[1]
            assert (
                cli.main(["coordinator", "--status", "--insecure", "--port", port, "--job", "cli-job", "--json"]) == 0
            )
            status = json.loads(capsys.readouterr().out)
            assert status["job"]["job"] == "cli-job"
            assert status["job"]["members"][0]["member_id"] == "replica-0"
            assert cli.main(["coordinator", "--status", "--insecure", "--port", port, "--job", "cli-job"]) == 0
            assert "replica-0" in capsys.readouterr().out
            assert cli.main(["coordinator", "--status", "--insecure", "--port", port, "--job", "nope"]) == 2
            assert "job 'nope' is unknown" in capsys.readouterr().err
    finally:
        s.stop(0.2)


def test_status_shows_every_version_still_on_the_volume_beyond_the_newest_ten(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from weightsync.channels.base import Offer
    from weightsync.coordinator.models import JobPolicy, TableSummary
    from weightsync.tensors import DIGEST_PREFIX, manifest_checksum

    s = server.CoordinatorServer(server.ServerConfig(insecure=True, port=0)).start()
    try:
        with CoordinatorClient(s.target, insecure=True) as trainer:
            caps = Capabilities(channels=(Channel.VOLUME,), volume_id="vol")
            policy = JobPolicy(ready_without_acks=True)  # versions no replica acks: READY once sent
            trainer.register_trainer("cli-job", "t", caps, policy=policy, offers=[Offer(Channel.VOLUME)])
            table = TableSummary(1, 8, DIGEST_PREFIX + "1" * 64)
            for step in range(1, 14):
                version = trainer.open_version(step, table).version
                trainer.report_sent(version, "", {})
                if version == 2:  # the one the volume keeps from long ago
                    trainer.mark_durable(version, "/ckpt/v00000002/manifest.json", manifest_checksum(b"2"))
            port = s.target.rsplit(":", 1)[1]
            assert (
                cli.main(["coordinator", "--status", "--insecure", "--port", port, "--job", "cli-job", "--json"]) == 0
            )
            shown = [v["version"] for v in json.loads(capsys.readouterr().out)["versions"]]
            assert shown == [*range(13, 3, -1), 2]
    finally:
        s.stop(0.2)
