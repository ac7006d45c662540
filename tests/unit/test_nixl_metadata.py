"""CPU-side checks of the NIXL channel: its plain metadata, its error messages, and a real host-memory round trip.

The metadata helpers need no NIXL; the round trip (two NIXL agents in one process,
DRAM, UCX) runs only where the ``nixl`` package imports, and is skipped elsewhere.
"""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch

from weightsync.channels import nixl, receiver_class, sender_class
from weightsync.channels.base import Rendezvous, UpdateTicket, WorkerContext, direct_rendezvous
from weightsync.errors import IntegrityError, PermanentError, TransferTimeoutError
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel

pytestmark = pytest.mark.unit

TABLE = TensorTable.build(
    [
        [("model.embed_tokens.weight", "bfloat16", (16, 8)), ("model.norm.weight", "bfloat16", (8,))],
        [("model.layers.0.mlp.down_proj.weight", "float32", (8, 4)), ("model.tail.bytes", "uint8", (1001,))],
    ]
)
HAVE_NIXL = importlib.util.find_spec("nixl") is not None


def _meta(**over: object) -> str:
    body: dict[str, object] = {
        "version": 3,
        "epoch": 1,
        "mem": "VRAM",
        "locations": [[4096 * (i + 1), 1] for i in range(len(TABLE))],
        "digests": {"model.norm.weight": "16:00000000000000ff"},
        "layout_digest": TABLE.layout_digest(),
    }
    body.update(over)
    return json.dumps(body)


def _tables(digest: str) -> TensorTable:
    """What the receiver's table cache answers: the table of a known layout, an error for another."""
    if digest != TABLE.layout_digest():
        raise IntegrityError(f"the layout digest {digest} is not the one the coordinator recorded")
    return TABLE


def _ticket(version: int = 3, **kw: object) -> UpdateTicket:
    """What a replica's ticket holds: no table (the channel carries it), the layout digest to check it against."""
    return UpdateTicket(version, Channel.NIXL, layout_digest=TABLE.layout_digest(), **kw)  # type: ignore[arg-type]


def test_channel_is_registered_and_its_module_imports_without_nixl() -> None:
    assert sender_class(Channel.NIXL) is nixl.NixlSender
    assert receiver_class("nixl") is nixl.NixlReceiver


def test_agent_metadata_round_trips_as_base64_text() -> None:
    md = bytes(range(256)) * 3
    text = nixl.encode_metadata(md)
    assert isinstance(text, str) and json.loads(json.dumps({"metadata": text}))["metadata"] == text
    assert nixl.decode_metadata(text, "init_info 'metadata'") == md


@pytest.mark.parametrize("bad", ["", "not base64!", 12, None])
def test_bad_agent_metadata_is_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(PermanentError, match="init_info 'metadata'"):
        nixl.decode_metadata(bad, "init_info 'metadata'")


def test_version_metadata_round_trips() -> None:
    locations = tuple((4096 * (i + 1), 1) for i in range(len(TABLE)))
    meta = nixl.VersionMeta(3, 2, "VRAM", locations, {"model.norm.weight": "16:00000000000000ff"}, TABLE)
    assert nixl.VersionMeta.parse(meta.to_json(), _ticket(), _tables) == meta


def test_version_metadata_errors_name_the_tensor_or_field() -> None:
    with pytest.raises(PermanentError, match="published for v3, the ticket asks for v4"):
        nixl.VersionMeta.parse(_meta(), _ticket(4), _tables)
    with pytest.raises(PermanentError, match="locates 1 tensors, the table has 4"):
        nixl.VersionMeta.parse(_meta(locations=[[1, 0]]), _ticket(), _tables)
    bad = [[4096, 1], [4096, 1], "oops", [4096, 1]]
    with pytest.raises(
        PermanentError, match=r"tensor 'model\.layers\.0\.mlp\.down_proj\.weight'.*expected \[address, device\]"
    ):
        nixl.VersionMeta.parse(_meta(locations=bad), _ticket(), _tables)
    with pytest.raises(PermanentError, match=re.escape("tensor 'model.embed_tokens.weight'")):
        nixl.VersionMeta.parse(_meta(locations=[None, [1, 0], [1, 0], [1, 0]]), _ticket(), _tables)
    with pytest.raises(PermanentError, match="memory kind 'HBM'"):
        nixl.VersionMeta.parse(_meta(mem="HBM"), _ticket(), _tables)
    with pytest.raises(PermanentError, match="v3 metadata is malformed"):
        nixl.VersionMeta.parse("{", _ticket(), _tables)
    other = TensorTable.build([[("x", "bfloat16", (2,))]])
    with pytest.raises(IntegrityError, match=r"layout digest .* the coordinator recorded"):
        nixl.VersionMeta.parse(_meta(layout_digest=other.layout_digest()), _ticket(), _tables)


def test_missing_rendezvous_field_is_named() -> None:
    rdv = Rendezvous(Channel.NIXL, agent="a")
    lacks = "nixl rendezvous lacks endpoint, group, secret, world_size, rank, metadata"
    with pytest.raises(PermanentError, match=lacks):
        nixl.NixlReceiver.start(rdv, WorkerContext())


needs_nixl = pytest.mark.skipif(not HAVE_NIXL, reason="the nixl package is not importable here")


@needs_nixl
def test_host_memory_round_trip_registers_once_and_verifies() -> None:
    sender = nixl.NixlSender("cpu", timeout_s=10)
    rdv = direct_rendezvous(sender.offer())
    sender.take_plan({"replica": rdv})
    receiver = nixl.NixlReceiver.start(Rendezvous.from_dict(json.loads(json.dumps(rdv.to_dict()))), WorkerContext())
    src = [
        [torch.randn(16, 8, dtype=torch.bfloat16), torch.randn(8, dtype=torch.float32)],  # the second is cast
        [torch.randn(8, 4), torch.randint(0, 256, (1001,), dtype=torch.uint8)],
    ]
    dests = {"model.embed_tokens.weight": torch.zeros(16, 8, dtype=torch.bfloat16)}
    try:
        for version in (1, 2, 3):
            if version == 3:  # fresh memory: moves into the sender's own buffer, once
                src[0][0] = src[0][0] + 1
            else:
                src[1][0].add_(1)
            ticket = UpdateTicket(version=version, channel=Channel.NIXL, table=TABLE, verify=True, timeout_s=10)
            sent = sender.send(ticket, src)
            yielded = [spec.name for group in receiver.receive(_ticket(version), lambda _: dests) for spec, _ in group]
            sender.release(version, 10)
            assert yielded == [s.name for s in TABLE][1:]  # everything but the in-place destination is staged
            assert receiver.in_place == {"model.embed_tokens.weight"}
            assert receiver.verified == sent.digests
            assert torch.equal(dests["model.embed_tokens.weight"], src[0][0])
            if version == 1:
                epoch, regs = sender.epoch, sender.registrations
            elif version == 2:
                assert (sender.epoch, sender.registrations) == (epoch, regs)  # nothing registered again
        assert sender.epoch == epoch + 1 and sender.registrations == regs
        with pytest.raises(TransferTimeoutError, match=re.escape("v9 metadata did not arrive within 0.6s")):
            list(receiver.receive(_ticket(9, timeout_s=0.5, join_timeout_s=0.1), lambda _: dests))
        with pytest.raises(TransferTimeoutError, match=re.escape("receiver 1's ack of v9 did not arrive within 0.5s")):
            sender.release(9, 0.5)
    finally:
        receiver.close()
        sender.close()


@needs_nixl
def test_metadata_of_another_agent_is_refused() -> None:
    import dataclasses

    sender = nixl.NixlSender("cpu", timeout_s=5)
    rdv = direct_rendezvous(sender.offer())
    sender.take_plan({"replica": rdv})
    with pytest.raises(PermanentError, match=r"describes agent 'weightsync-trainer-.*', expected 'someone-else'"):
        nixl.NixlReceiver.start(dataclasses.replace(rdv, agent="someone-else"), WorkerContext())
    with pytest.raises(PermanentError, match="NIXL could not load the rendezvous' agent metadata"):
        nixl.NixlReceiver.start(dataclasses.replace(rdv, metadata=b"garbage"), WorkerContext())
    sender.close()
