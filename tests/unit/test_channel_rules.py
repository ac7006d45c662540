"""The channel rules, in the one module both ends and the coordinator read: each rule with what breaks it."""

from __future__ import annotations

import pytest

from weightsync.channels import rules
from weightsync.channels.base import Endpoint, Offer
from weightsync.channels.rules import Capabilities, EngineKind
from weightsync.vocabulary import Channel

pytestmark = pytest.mark.unit

ALL = tuple(Channel)
GPU_END = Capabilities(host="n1", gpu_uuids=("GPU-0",), nccl_domain="rack", nixl=True, volume_mount="/ckpt",
                       engine=EngineKind.GPU)  # fmt: skip
CPU_END = Capabilities(host="n1", volume_mount="/ckpt")


def test_a_gpu_trainer_sends_every_channel_and_a_cpu_one_what_needs_no_gpu() -> None:
    assert rules.usable(ALL, GPU_END, sends=True) == (ALL, {})
    channels, why = rules.usable(ALL, CPU_END, sends=True)
    assert channels == (Channel.CPU, Channel.VOLUME)
    assert why[Channel.IPC] == "the trainer's weights are not on a GPU"
    assert why[Channel.NCCL] == "the job has no NCCL domain"
    assert why[Channel.NIXL].startswith("NIXL is not importable")


def test_a_replica_receives_by_its_engine() -> None:
    channels, why = rules.usable(ALL, GPU_END, sends=False)
    assert Channel.CPU not in channels and why[Channel.CPU] == "the engine runs on GPUs"
    channels, why = rules.usable(ALL, CPU_END, sends=False)
    assert channels == (Channel.CPU, Channel.VOLUME)
    assert why[Channel.IPC] == "the engine runs on the CPU"
    assert why[Channel.NIXL] == "NIXL is not importable in every worker"


def test_nixl_moves_host_memory_only_when_told_to() -> None:
    cpu_with_nixl = Capabilities(nixl=True, volume_mount="/ckpt")
    assert rules.own(Channel.NIXL, cpu_with_nixl, sends=True) == (
        "the trainer's weights are not on a GPU (WEIGHTSYNC_NIXL_MEMORY=host lets NIXL move host memory)"
    )
    assert rules.own(Channel.NIXL, cpu_with_nixl, sends=False).startswith("the engine runs on the CPU (")
    assert rules.own(Channel.NIXL, cpu_with_nixl, sends=True, nixl_memory="host") == ""
    assert rules.own(Channel.NIXL, cpu_with_nixl, sends=False, nixl_memory="host") == ""
    assert rules.own(Channel.NIXL, CPU_END, sends=False, nixl_memory="host") == "NIXL is not importable in every worker"


def test_the_nixl_memory_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from weightsync.channels import nixl
    from weightsync.errors import PermanentError

    assert nixl.memory() == "device"
    monkeypatch.setenv(nixl.MEMORY_ENV, "host")
    assert nixl.memory() == "host"
    monkeypatch.setenv(nixl.MEMORY_ENV, "dram")
    with pytest.raises(PermanentError, match="WEIGHTSYNC_NIXL_MEMORY='dram'; use device"):
        nixl.memory()


def test_nccl_on_the_cpu_only_over_its_gloo_transport() -> None:
    cpu_with_domain = Capabilities(nccl_domain="rack", volume_mount="/ckpt")
    assert rules.own(Channel.NCCL, cpu_with_domain, sends=True, nccl_transport="nccl") == (
        "the trainer's weights are not on a GPU"
    )
    assert rules.own(Channel.NCCL, cpu_with_domain, sends=True, nccl_transport="gloo") == ""
    assert rules.own(Channel.NCCL, cpu_with_domain, sends=False, nccl_transport="gloo") == ""


def test_no_volume_no_volume_channel() -> None:
    assert rules.own(Channel.VOLUME, Capabilities(), sends=True) == "no checkpoint directory"
    assert rules.own(Channel.VOLUME, Capabilities(), sends=False) == "no checkpoint volume mounted"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.4.5", "::1", "localhost"])
def test_a_loopback_endpoint_is_refused_for_a_replica_on_another_host(host: str) -> None:
    trainer = Capabilities(host="node-a", channels=ALL)
    offer = Offer(Channel.CPU, Endpoint(host, 29500))
    remote = Capabilities(host="node-b", channels=(Channel.CPU,))
    reason = rules.between(Channel.CPU, trainer, offer, remote)
    assert "loopback endpoint" in reason and "POD_IP" in reason and "'node-b'" in reason
    assert rules.between(Channel.CPU, trainer, offer, Capabilities(host="node-a", channels=(Channel.CPU,))) == ""
    assert rules.between(Channel.CPU, trainer, Offer(Channel.CPU, Endpoint("10.0.0.7", 1)), remote) == ""


def test_host_only_tells_addresses_and_names_apart() -> None:
    assert rules.host_only(Endpoint("127.0.0.1", 1)) == rules.host_only(Endpoint("db.localhost", 1)) == "loopback"
    assert rules.host_only(Endpoint("169.254.3.4", 1)) == rules.host_only(Endpoint("fe80::1", 1)) == "link-local"
    assert rules.host_only(Endpoint("224.0.0.1", 1)) == "not a host's address"
    assert not rules.host_only(Endpoint("10.1.2.3", 1)) and not rules.host_only(Endpoint("trainer.svc", 1))
    trainer = Capabilities(host="a", channels=ALL, nccl_domain="d")
    remote = Capabilities(host="b", channels=(Channel.NCCL,), nccl_domain="d")
    offer = Offer(Channel.NCCL, Endpoint("169.254.3.4", 29500))
    assert "link-local endpoint" in rules.between(Channel.NCCL, trainer, offer, remote)
