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
