from __future__ import annotations

import subprocess

import pytest

from weightsync.cli import main
from weightsync.cli._localfleet import weightsync_cmd

pytestmark = pytest.mark.unit


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in main.COMMANDS:
        assert name in out


def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main.main([]) == main.EXIT_USAGE
    assert "usage: weightsync" in capsys.readouterr().out


def test_sandbox_help_reads_well_and_names_env(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main.main(["sandbox", "--help"])
    out = capsys.readouterr().out
    assert "--channel" in out and "[env: WEIGHTSYNC_CHANNEL]" in out and "--json" in out


def test_env_var_supplies_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHTSYNC_CHANNEL", "volume")
    args = main.build_parser().parse_args(["sandbox"])
    assert args.channel == "volume"


def test_models_rejects_unknown_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert main.main(["models", "nope"]) == 2
    assert "unknown preset(s) nope" in capsys.readouterr().out


def test_agent_gives_up_on_a_vllm_that_never_answers() -> None:
    # nothing listens on port 1: /health never answers, and the agent says so after its wait, exit 1
    argv = ["--vllm-url", "http://127.0.0.1:1", "--wait-vllm", "1.5", "--coordinator", "127.0.0.1:1", "--insecure"]
    done = subprocess.run(weightsync_cmd("agent", *argv), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "vLLM at http://127.0.0.1:1 is not ready after 2s" in done.stderr


def test_operator_refuses_a_renew_deadline_that_could_let_two_leaders_overlap() -> None:
    args = ["operator", "--leader-elect-lease-seconds", "15", "--leader-elect-renew-deadline-seconds", "20"]
    with pytest.raises(SystemExit) as exc:
        main.main(args)
    assert str(exc.value) == (
        "weightsync operator: leader election needs 0 < retry (2.0s) < renew deadline (20.0s) < lease duration (15.0s)"
    )


def test_the_sandbox_sees_a_change_in_logprobs_when_no_greedy_token_changed() -> None:
    """One step may move every logit without changing an argmax (a tied Gemma moved ~1.5 nats): the change is
    measured on the greedy tokens both runs share, up to the first that differs."""
    from weightsync.cli import sandbox

    same_tokens = sandbox._logprob_change([([3, 4], [-1.0, -2.0])], [([3, 4], [-2.5, -2.1])])
    assert same_tokens == pytest.approx(1.5)
    assert sandbox._logprob_change([([3, 4], [-1.0, -2.0])], [([3, 9], [-1.05, -9.0])]) == pytest.approx(0.05)


def test_run_without_a_command_says_how_to_give_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main.main(["run"]) == main.EXIT_USAGE
    assert "give the trainer command after --" in capsys.readouterr().err


def test_the_local_endpoint_forwards_each_connection_to_the_next_upstream_and_skips_a_dead_one() -> None:
    """`weightsync run`'s stand-in for the job's OpenAI Service: bytes through unchanged, round robin."""
    import socket
    import threading

    from weightsync.cli._endpoint import Endpoint
    from weightsync.cli._localfleet import free_port

    def echo_server(tag: bytes) -> int:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()

        def serve() -> None:
            while True:
                conn, _ = s.accept()
                with conn:
                    conn.sendall(tag + conn.recv(100))

        threading.Thread(target=serve, daemon=True).start()
        return int(s.getsockname()[1])

    dead = free_port()  # nothing listens there: a replica that is down
    a, b = echo_server(b"a:"), echo_server(b"b:")
    endpoint = Endpoint(f"127.0.0.1:{free_port()}", [f"127.0.0.1:{a}", f"127.0.0.1:{dead}", f"127.0.0.1:{b}"])
    endpoint.start()
    try:
        seen = []
        for _ in range(4):
            with socket.create_connection(("127.0.0.1", int(endpoint.listen.rsplit(":", 1)[1])), timeout=5) as c:
                c.sendall(b"x-weightsync-versions: 3")
                seen.append(c.recv(100))
        assert seen == [b"a:x-weightsync-versions: 3", b"b:x-weightsync-versions: 3"] * 2
    finally:
        endpoint.stop()
