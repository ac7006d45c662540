"""The pieces the framework integrations share: version gates, stream tables, served versions, completions.

The integrations themselves run against real frameworks, replicas and a coordinator in
tests/integration/test_frameworks.py; these pin the rules those runs rely on.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from weightsync.errors import ModelMismatchError, PermanentError
from weightsync.served import VERSIONS_HEADER, Served
from weightsync_trainer.integrations import completions, frameworks, streams

pytestmark = pytest.mark.unit


# ---- version gates ---------------------------------------------------------------------------------------------------


def test_an_installed_framework_in_range_passes() -> None:
    frameworks.require("trl")  # the test environment installs the pinned trl


def test_a_framework_outside_its_range_is_refused_naming_range_version_and_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    trl = frameworks.SUPPORTED["trl"]
    monkeypatch.setitem(frameworks.SUPPORTED, "trl", dataclasses.replace(trl, supported=">=2.0,<2.1"))
    with pytest.raises(frameworks.UnsupportedFramework) as e:
        frameworks.require("trl")
    message = str(e.value)
    assert "supports trl >=2.0,<2.1; installed: 1.16.0" in message
    assert "pip install 'weightsync[trl]'" in message


def test_a_missing_framework_is_refused_naming_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    missing = frameworks.Framework("Nothing", ("weightsync-no-such-framework",), ">=1,<2", "nothing")
    monkeypatch.setitem(frameworks.SUPPORTED, "nothing", missing)
    with pytest.raises(frameworks.UnsupportedFramework, match=r"needs weightsync-no-such-framework >=1,<2, which is"):
        frameworks.require("nothing")


def test_vllms_cpu_build_counts_as_vllm_and_its_local_tag_is_ignored() -> None:
    assert frameworks.installed(frameworks.SUPPORTED["vllm"]) == "0.32.0"
    frameworks.require("vllm")


def test_every_extra_pins_a_version_inside_its_supported_range() -> None:
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for key, framework in frameworks.SUPPORTED.items():
        pins = [Requirement(r) for r in extras[framework.extra]]
        pin = next(r for r in pins if r.name in framework.distributions)
        version = next((s.version for s in pin.specifier if s.operator == "=="), None)
        if version is not None:  # an exact pin must lie inside the range the run-time gate accepts
            assert pin.specifier.contains(version) and version in frameworks.SpecifierSet(framework.supported), key


def test_the_test_environment_installs_the_frameworks_at_their_extras_pins() -> None:
    """requirements/integrations.txt (what tools/setup-env.sh, so make test, installs) holds each framework at the
    version its extra pins: CI runs the framework tests against what `pip install 'weightsync[trl]'` gives a user."""
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    root = Path(__file__).parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    lines = (root / "requirements" / "integrations.txt").read_text().splitlines()
    installed = {r.name: r.specifier for r in (Requirement(x) for x in lines if x and not x.startswith("#"))}
    for extra in ("trl", "atropos"):
        pins = [r for r in map(Requirement, extras[extra]) if any(s.operator == "==" for s in r.specifier)]
        assert pins, extra
        for pin in pins:
            assert installed.get(pin.name) == pin.specifier, (extra, pin, installed.get(pin.name))


# ---- streams ---------------------------------------------------------------------------------------------------------


def _model_pairs(scale: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(8, 4) * scale),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(4, 4) * scale),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(6, 4) * scale),
        ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.randn(2)),
        ("model.layers.1.self_attn.q_proj.weight", torch.randn(4, 4) * scale),
        ("model.norm.weight", torch.ones(4) * scale),
        ("lm_head.weight", torch.randn(8, 4) * scale),
    ]


def test_the_first_sync_learns_the_table_in_stream_order_with_one_group_per_layer() -> None:
    source = streams.StreamSource()
    source.feed(iter(_model_pairs()))
    table = source.table()
    assert [s.name for s in table] == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]  # the rotary cache is skipped: the engine recomputes it
    assert table.group_starts == (0, 1, 3, 4)
    assert {s.dtype for s in table} == {"bfloat16"}
    groups = list(source.groups())
    assert [len(g) for g in groups] == [1, 2, 1, 2]
    assert torch.equal(groups[0][0], _model_pairs()[0][1].to(torch.bfloat16))


def test_later_syncs_stream_from_the_iterator_and_a_changed_model_fails_naming_the_tensor() -> None:
    source = streams.StreamSource()
    source.feed(iter(_model_pairs()))
    list(source.groups())
    source.feed(iter(_model_pairs(2.0)))
    assert torch.equal(list(source.groups())[-1][-1], (_model_pairs(2.0)[-1][1]).to(torch.bfloat16))

    taken: list[str] = []

    def changed() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in _model_pairs():
            taken.append(name)
            yield (name, torch.zeros(5, 4)) if name == "model.layers.1.self_attn.q_proj.weight" else (name, t)

    source.feed(changed())
    with pytest.raises(ModelMismatchError, match=r"sent tensor 'model.layers.1.self_attn.q_proj.weight' \(5, 4\)"):
        list(source.groups())
    assert len(taken) == len(_model_pairs())  # drained: other ranks may be gathering the rest


def test_an_extra_tensor_after_the_table_is_recorded_as_the_passes_error() -> None:
    source = streams.StreamSource()
    source.feed(iter(_model_pairs()))
    list(source.groups())
    source.feed(iter([*_model_pairs(), ("model.extra.weight", torch.zeros(1))]))
    list(source.groups())
    assert "sent tensor 'model.extra.weight' after the table's last one" in source.error


def test_a_declared_table_needs_no_first_pass_and_a_pass_is_consumed_once() -> None:
    source = streams.StreamSource.declared([(n, t.dtype, tuple(t.shape)) for n, t in _model_pairs()], None)
    assert source.table().tensors[0].dtype == "float32"
    with pytest.raises(PermanentError, match="feed\\(\\) the pairs of each sync"):
        list(source.groups())


def _taking(taken: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's pairs, each name appended to ``taken`` as it is taken (the framework's gather for it ran)."""
    for name, t in _model_pairs():
        taken.append(name)
        yield name, t


def test_a_stream_publisher_on_another_rank_only_drains() -> None:
    taken: list[str] = []
    assert streams.StreamPublisher(rank=1, env={}).publish(_taking(taken), step=0) is None
    assert len(taken) == len(_model_pairs())


def test_trls_weight_transfer_without_publishing_drains_each_sync_and_records_no_version() -> None:
    from weightsync_trainer.integrations import trl as weightsync_trl

    taken: list[str] = []
    transfer = weightsync_trl.WeightTransfer(publish=False, env={})  # no coordinator: nothing may try to reach one
    transfer.send_weights(_taking(taken))
    transfer.send_weights(_taking(taken))
    transfer.destroy()
    assert transfer.versions == [0, 0] and transfer.last is None and transfer.stream.publisher is None
    assert len(taken) == 2 * len(_model_pairs())  # TRL's gathers ran to the end on every sync


# ---- served versions and completions ---------------------------------------------------------------------------------


def test_the_proxy_and_its_clients_name_the_same_header() -> None:
    from weightsync_inference import proxy

    assert proxy.VERSIONS_HEADER == VERSIONS_HEADER


@pytest.mark.parametrize(
    ("text", "served"), [("12", Served(12, 12)), ("12,13", Served(12, 13)), (" 0 ", Served(0, 0)), (None, None)]
)
def test_served_parses_the_header(text: str | None, served: Served | None) -> None:
    assert Served.parse(text) == served


@pytest.mark.parametrize("text", ["v12", "12,", "13,12", "-1"])
def test_a_malformed_header_is_refused(text: str) -> None:
    with pytest.raises(PermanentError):
        Served.parse(text)


def test_a_sample_of_several_turns_spans_their_versions_and_is_unknown_if_one_is() -> None:
    assert Served.span([Served(3, 3), Served(4, 5)]) == Served(3, 5)
    assert Served.span([Served(3, 3), None]) is None
    assert Served(4, 4).on_policy(4) and not Served(4, 5).on_policy(5)


def _answer(n: int) -> dict[str, object]:
    return {
        "choices": [
            {"index": i, "token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.5, -1.5]}, "finish_reason": "length"}
            for i in reversed(range(n))
        ]
    }


def test_a_completions_answer_parses_into_tokens_logprobs_and_versions() -> None:
    out = completions.parse("http://x", _answer(2), {VERSIONS_HEADER: "7,8"}, [1, 2], 2)
    assert [c.token_ids for c in out] == [(5, 6), (5, 6)]
    assert out[0].logprobs == (-0.5, -1.5) and out[0].served == Served(7, 8) and out[0].finish_reason == "length"


def test_a_completions_answer_without_logprobs_or_with_the_wrong_count_is_refused() -> None:
    with pytest.raises(PermanentError, match="answered 1 choices for n=2"):
        completions.parse("http://x", _answer(1), {}, [1], 2)
    broken = _answer(1)
    broken["choices"][0]["logprobs"] = None  # type: ignore[index]
    with pytest.raises(PermanentError, match=r"choice 0: token_ids and logprobs\.token_logprobs"):
        completions.parse("http://x", broken, {}, [1], 1)


def test_the_endpoint_comes_from_the_operators_variable_and_is_named_when_missing() -> None:
    assert completions.endpoint({"WEIGHTSYNC_OPENAI_URL": "http://job-openai.ns.svc:8000/v1/"}) == (
        "http://job-openai.ns.svc:8000"
    )
    with pytest.raises(PermanentError, match=r"\$WEIGHTSYNC_OPENAI_URL is not set: the operator sets it"):
        completions.endpoint({})


# ---- the proxy forwards what the integrations' clients use, not the routes of the frameworks' own syncs -----------


CLIENT_ROUTES = [
    # TRL AsyncGRPOTrainer's rollout worker and VLLMClient (readiness, max_model_len, generation)
    ("GET", "/health"),
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    # RolloutFunc, WeightsyncServer (Atropos): generation and its readiness probe
    ("HEAD", "/health"),
]
NATIVE_SYNC_ROUTES = [
    # TRL's WeightTransferClient and its server probes, GRPOTrainer's server-mode start-up
    ("POST", "/init_weight_transfer_engine"),
    ("POST", "/pause"),
    ("POST", "/update_weights"),
    ("GET", "/server_info"),
    ("GET", "/get_world_size"),
    ("POST", "/v1/load_lora_adapter"),
    # Atropos's built-in vLLM server class
    ("POST", "/generate"),
]


@pytest.mark.parametrize(("method", "path"), CLIENT_ROUTES)
def test_the_proxy_forwards_every_route_the_integrations_clients_call(method: str, path: str) -> None:
    from weightsync_inference import proxy

    assert proxy.route_decision(method, path) == 200


@pytest.mark.parametrize(("method", "path"), NATIVE_SYNC_ROUTES)
def test_the_proxy_refuses_the_routes_of_the_frameworks_own_weight_sync(method: str, path: str) -> None:
    from weightsync_inference import proxy

    assert proxy.route_decision(method, path) == 404


class _Replica:
    """A real HTTP server answering /v1/completions with the given statuses in turn (then 200 with a completion)."""

    def __init__(self, statuses: list[int]) -> None:
        import http.server
        import json
        import threading

        statuses = list(statuses)
        self.requests: list[dict[str, object]] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                owner.requests.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
                status = statuses.pop(0) if statuses else 200
                body = json.dumps(_answer(2) if status == 200 else {"error": "no"}).encode()
                self.send_response(status)
                self.send_header(VERSIONS_HEADER, "4")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def _complete(blocking: bool, url: str, prompt_ids: list[int], n: int, sampling: completions.Sampling) -> Any:
    """``complete`` through the blocking client (TRL's ``RolloutFunc``) or the asyncio one (Atropos's server)."""
    if blocking:
        return completions.Client(url, timeout_s=5).complete(prompt_ids, n, sampling)

    async def run() -> list[completions.Completion]:
        client = completions.AsyncClient(url, timeout_s=5)
        try:
            return await client.complete(prompt_ids, n, sampling)
        finally:
            await client.aclose()

    return asyncio.run(run())


BOTH_CLIENTS = pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "asyncio"])


@BOTH_CLIENTS
def test_the_client_retries_a_gateway_error_and_sends_token_prompts_asking_for_ids_and_logprobs(
    monkeypatch: pytest.MonkeyPatch, blocking: bool
) -> None:
    monkeypatch.setattr(completions, "BACKOFF_S", 0.01)
    replica = _Replica([502, 503])
    out = _complete(blocking, replica.url + "/v1", [1, 2, 3], 2, completions.Sampling(max_tokens=2, seed=7))
    assert [c.served for c in out] == [Served(4, 4)] * 2 and len(replica.requests) == 3
    assert replica.requests[-1] == {
        "prompt": [1, 2, 3], "n": 2, "max_tokens": 2, "temperature": 1.0, "top_p": 1.0, "logprobs": 0,
        "return_token_ids": True, "seed": 7,
    }  # fmt: skip
    replica.server.shutdown()


@BOTH_CLIENTS
def test_the_client_gives_up_at_once_on_a_refusal_and_after_its_attempts_on_a_dead_endpoint(
    monkeypatch: pytest.MonkeyPatch, blocking: bool
) -> None:
    from weightsync.cli._localfleet import free_port
    from weightsync.errors import RetryableError

    monkeypatch.setattr(completions, "BACKOFF_S", 0.01)
    replica = _Replica([400])
    with pytest.raises(PermanentError, match="refused the request: HTTP 400"):
        _complete(blocking, replica.url, [1], 2, completions.Sampling())
    assert len(replica.requests) == 1
    replica.server.shutdown()
    with pytest.raises(RetryableError, match=f"failed {completions.ATTEMPTS} times, last: ConnectError"):
        _complete(blocking, f"http://127.0.0.1:{free_port()}", [1], 2, completions.Sampling())
    gateway = _Replica([503] * completions.ATTEMPTS)
    with pytest.raises(RetryableError, match=f"failed {completions.ATTEMPTS} times, last: HTTP 503"):
        _complete(blocking, gateway.url, [1], 2, completions.Sampling())
    assert len(gateway.requests) == completions.ATTEMPTS
    gateway.server.shutdown()


def test_the_atropos_server_answers_completions_and_chat_as_openai_objects_and_records_versions() -> None:
    """``WeightsyncServer``'s text and chat wrappers (Atropos calls them under its semaphore and retries): token-id
    requests to /v1/completions, the tokens decoded into OpenAI objects, each completion's versions recorded."""
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig

    from tests import support
    from weightsync_trainer.integrations import atropos

    replica = _Replica([])
    model = str(support.tiny_model())
    server = atropos.WeightsyncServer(APIServerConfig(base_url=replica.url, model_name=model, timeout=5))
    server.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    text = server.tokenizer.decode([5, 6])

    async def run() -> tuple[Any, Any, list[Served | None]]:
        with atropos.served_versions() as versions:
            completion = await server._completion_wrapper(prompt="hello world", n=2, max_new_tokens=2)
            chat = await server._chat_completion_wrapper(messages=[{"role": "user", "content": "hello"}], n=2)
        await server.client.aclose()
        return completion, chat, versions

    completion, chat, versions = asyncio.run(run())
    replica.server.shutdown()
    assert [(c.index, c.text, c.finish_reason) for c in completion.choices] == [
        (0, text, "length"),
        (1, text, "length"),
    ]
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-") and completion.model == model
    assert [(c.message.content, c.finish_reason) for c in chat.choices] == [(text, "length")] * 2
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    assert versions == [Served(4, 4)] * 4
    hello = server.tokenizer.encode("hello world", add_special_tokens=False)
    assert replica.requests[0]["prompt"] == hello and replica.requests[0]["max_tokens"] == 2
    assert replica.requests[1]["prompt"] == server.tokenizer.encode("hello", add_special_tokens=False)
