"""A real vLLM CPU engine loads trainer weights from the checkpoint volume, verified.

One engine serves the whole module (starting one costs ~20-40 s); the tests run in order
and each leaves it serving a whole, known version. What the engine loaded is checked
against its own receipt: the digests it computed while loading, read back from its
worker through vLLM's ``collective_rpc``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests import support
from weightsync.channels import manifests
from weightsync.channels.base import Rendezvous, UpdateTicket
from weightsync.channels.volume import VolumeSender
from weightsync.tensors import TensorTable, manifest_checksum
from weightsync.vocabulary import Channel, EngineState, SyncPhase
from weightsync_inference.lifecycle import Replica, UpdateFailed, UpdateOutcome
from weightsync_inference.staging import staging_bytes
from weightsync_trainer.publisher import send
from weightsync_trainer.sources import LoraMergedSource, ModuleSource, WeightSource

pytestmark = pytest.mark.integration


@dataclass
class Published:
    version: int
    table: TensorTable
    digests: dict[str, str]
    checksum: str
    """The manifest checksum, as the coordinator records it when the version becomes durable."""

    def ticket(self, channel: Channel = Channel.VOLUME) -> UpdateTicket:
        """What a replica is handed: no table (the manifest carries it), the layout digest and manifest checksum."""
        return UpdateTicket(
            self.version,
            channel,
            layout_digest=self.table.layout_digest(),
            manifest_checksum=self.checksum,
            step=self.version,
        )


class Live:
    def __init__(self, root: Path) -> None:
        from weightsync_inference.offline import OfflineEngine

        self.root = root
        self.folder = support.tiny_model()
        self.engine = OfflineEngine(self.folder, Channel.VOLUME)
        self.replica = Replica(self.engine)
        self.replica.init_transfer(Rendezvous(Channel.VOLUME, root=str(root)).to_dict())
        self.sender = VolumeSender(root)
        self.version = 0

    def publish(self, source: WeightSource) -> Published:
        self.version += 1
        table = source.table()
        report = send(source, self.sender, UpdateTicket(self.version, Channel.VOLUME, table, step=self.version))
        checksum = manifest_checksum(manifests.manifest_path(self.root, self.version).read_bytes())
        return Published(self.version, table, report.digests, checksum)

    def apply(self, published: Published) -> UpdateOutcome:
        outcome = self.replica.apply(published.ticket())
        receipt = outcome.receipt
        assert receipt.ok and receipt.version == published.version and not receipt.torn
        assert receipt.layout_digest == published.table.layout_digest()
        assert self.engine.receipt() == receipt  # what collective_rpc reads back is what the lifecycle acked
        return outcome


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    live = Live(tmp_path_factory.mktemp("volume"))
    yield live
    live.engine.close()


def test_engine_generates_tokens(live: Live) -> None:
    out = live.engine.greedy(support.PROMPTS, support.TOKENS)
    assert all(len(tokens) == support.TOKENS for tokens, _ in out)
    assert live.engine.receipt().version == 0  # no update yet
    (identity,) = live.engine.identity()
    assert (identity.rank, identity.world_size, identity.gpu) == (0, 1, False)


def test_transformers_model_syncs_bit_exact(live: Live) -> None:
    trainer = support.hf_trainer(live.folder, seed=1)
    before = live.engine.greedy(support.PROMPTS, support.TOKENS)
    published = live.publish(ModuleSource(trainer))
    outcome = live.apply(published)
    receipt = outcome.receipt
    assert dict(receipt.digests) == published.digests and len(published.digests) == len(published.table)
    # the volume reads into fresh tensors: everything goes through vLLM's loaders
    assert receipt.in_place == () and set(receipt.loader) == {s.name for s in published.table}
    assert set(outcome.seconds) == set(SyncPhase) - {SyncPhase.PUBLISH}
    assert outcome.seconds[SyncPhase.TOTAL] >= outcome.seconds[SyncPhase.LOAD] > 0
    assert live.engine.weight_version() == str(live.version)
    assert live.engine.greedy(support.PROMPTS, support.TOKENS) != before
    support.assert_generates_like(live.engine, trainer)


def test_offline_engine_switches_a_staged_version_in_one_call(live: Live) -> None:
    """``OfflineEngine`` stages a version beside its weights and switches it in with one ``collective_rpc``
    (``weightsync_switch``), its reported version set around the call; the receipt is the engine's own."""
    trainer = support.hf_trainer(live.folder, seed=5)
    before = live.engine.greedy(support.PROMPTS, support.TOKENS)
    published = live.publish(ModuleSource(trainer))
    ticket = published.ticket()
    live.replica.stage(ticket, staging_bytes(published.table.total_bytes, len(published.table)))
    staged = live.replica.wait_staged(ticket)
    assert live.engine.greedy(support.PROMPTS, support.TOKENS) == before  # staged beside: nothing switched yet
    outcome = live.replica.switch(ticket, staged)
    assert outcome.receipt.ok and outcome.receipt == live.engine.receipt()
    assert dict(outcome.receipt.digests) == published.digests
    assert live.engine.weight_version() == str(published.version)
    support.assert_generates_like(live.engine, trainer)


class PlainModule(torch.nn.Module):
    """No transformers: parameters under checkpoint names, built from a state dict."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, value in state.items():
            *path, leaf = name.split(".")
            mod: torch.nn.Module = self
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, torch.nn.Parameter(value.clone()))


def test_plain_module_syncs(live: Live) -> None:
    trainer = support.hf_trainer(live.folder, seed=2)
    plain = PlainModule({n: p.detach() for n, p in trainer.named_parameters()})
    published = live.publish(ModuleSource(plain))
    assert dict(live.apply(published).receipt.digests) == published.digests
    support.assert_generates_like(live.engine, trainer)


def test_lora_merged_syncs(live: Live) -> None:
    import peft

    trainer = support.hf_trainer(live.folder, seed=3)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    lora = peft.get_peft_model(trainer, config)
    source = LoraMergedSource(lora)
    assert not any("lora" in s.name for s in source.table())
    published = live.publish(source)
    assert dict(live.apply(published).receipt.digests) == published.digests
    merged = lora.merge_and_unload()
    support.assert_generates_like(live.engine, merged)


def _refused_untouched(live: Live, ticket: UpdateTicket, match: str) -> None:
    """``ticket`` is refused before any parameter changed: the replica keeps serving, its receipt says not torn."""
    with pytest.raises(UpdateFailed, match=match) as err:
        live.replica.apply(ticket)
    assert err.value.state is EngineState.SERVING and live.replica.state is EngineState.SERVING
    receipt = live.engine.receipt()
    assert not receipt.ok and not receipt.torn and receipt.version == ticket.version


def test_corrupt_shard_is_refused_and_previous_version_keeps_serving(live: Live) -> None:
    serving = support.hf_trainer(live.folder, seed=4)
    live.apply(live.publish(ModuleSource(serving)))

    published = live.publish(ModuleSource(support.hf_trainer(live.folder, seed=5)))
    shard = live.root / f"v{live.version:08d}" / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    _refused_untouched(
        live, published.ticket(), r"shard-00000.safetensors of version \d+: sha256 .* tensor '.*' has changed"
    )
    support.assert_generates_like(live.engine, serving)

    shard.write_bytes(bytes(data[: len(data) // 3]))  # truncated this time
    _refused_untouched(live, published.ticket(), r"shard is truncated .* is cut off")
    support.assert_generates_like(live.engine, serving)


def test_replaced_manifest_or_other_layout_is_refused(live: Live) -> None:
    serving = support.hf_trainer(live.folder, seed=9)
    live.apply(live.publish(ModuleSource(serving)))

    published = live.publish(ModuleSource(support.hf_trainer(live.folder, seed=10)))
    # a self-consistent manifest (every shard still matches it) that is not the one the coordinator recorded
    path = manifests.manifest_path(live.root, published.version)
    raw = json.loads(path.read_text())
    path.write_text(json.dumps(dict(raw, created=raw["created"] + 1), indent=1))
    _refused_untouched(live, published.ticket(), r"manifest checksum .* is not the .* the coordinator recorded")
    support.assert_generates_like(live.engine, serving)

    # the coordinator recorded another layout for this version than the one on the volume
    other = UpdateTicket(published.version, Channel.VOLUME, layout_digest="0" * 64)
    _refused_untouched(live, other, r"layout digest .* the coordinator recorded 0{64}")
    support.assert_generates_like(live.engine, serving)


def test_unknown_or_unready_channel_is_refused_untouched(live: Live) -> None:
    published = live.publish(ModuleSource(support.hf_trainer(live.folder, seed=6)))
    for channel, message in [(Channel.NIXL, "no .nixl. receiver"), (Channel.CPU, "no .cpu. receiver")]:
        _refused_untouched(live, published.ticket(channel), message)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("extra", r"tensor 'model.layers.0.mlp.bogus.weight': vLLM's loader for Qwen2ForCausalLM refuses it"),
        ("missing", r"parameter 'model.norm.weight' would be filled with 0 of its 256 elements"),
        ("shape", r"tensor 'model.layers.1.mlp.down_proj.weight': vLLM's loader for Qwen2ForCausalLM refuses it"),
        ("dtype", r"tensor 'model.norm.weight': dtype float16, the engine holds bfloat16"),
    ],
)
def test_model_mismatch_is_refused_naming_the_tensor(live: Live, change: str, message: str) -> None:
    serving = support.hf_trainer(live.folder, seed=7)
    live.apply(live.publish(ModuleSource(serving)))

    state = {n: p.detach().to(torch.bfloat16) for n, p in support.hf_trainer(live.folder, seed=8).named_parameters()}
    if change == "extra":
        state["model.layers.0.mlp.bogus.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    elif change == "missing":
        del state["model.norm.weight"]
    elif change == "shape":
        state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(256, 100, dtype=torch.bfloat16)
    else:
        state["model.norm.weight"] = state["model.norm.weight"].half()
    published = live.publish(ModuleSource(PlainModule(state), wire_dtype=None))
    _refused_untouched(live, published.ticket(), message)
    support.assert_generates_like(live.engine, serving)
