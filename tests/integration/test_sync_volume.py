"""A real vLLM CPU engine loads trainer weights from the checkpoint volume, verified.

One engine serves the whole module (starting one costs ~20-40 s); the tests run in order
and each leaves it serving a whole, known version.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests import support
from weightsync.channels.volume import VolumeSender
from weightsync.vocabulary import Channel
from weightsync_inference.lifecycle import Replica, ReplicaState, UpdateFailed
from weightsync_trainer.publisher import Publisher
from weightsync_trainer.sources import LoraMergedSource, ModuleSource, WeightSource

pytestmark = pytest.mark.integration


class Live:
    def __init__(self, root: Path) -> None:
        from weightsync_inference.offline import OfflineEngine

        self.root = root
        self.folder = support.tiny_model()
        self.engine = OfflineEngine(self.folder, Channel.VOLUME)
        self.replica = Replica(self.engine)
        self.replica.init_transfer({"root": str(root), "receipt_dir": str(root / "receipts")})
        self.version = 0

    def publish(self, source: WeightSource) -> tuple[Publisher, dict[str, str]]:
        self.version += 1
        pub = Publisher(source, [VolumeSender(self.root)])
        report = pub.publish(self.version, step=self.version)
        return pub, report.digests

    def receipt(self, version: int) -> dict[str, str]:
        data = json.loads((self.root / "receipts" / f"v{version:08d}-rank0.json").read_text())
        return dict(data["digests"])


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    live = Live(tmp_path_factory.mktemp("volume"))
    yield live
    live.engine.close()


def test_engine_generates_tokens(live: Live) -> None:
    out = live.engine.greedy(support.PROMPTS, support.TOKENS)
    assert all(len(tokens) == support.TOKENS for tokens, _ in out)


def test_transformers_model_syncs_bit_exact(live: Live) -> None:
    trainer = support.hf_trainer(live.folder, seed=1)
    before = live.engine.greedy(support.PROMPTS, support.TOKENS)
    pub, digests = live.publish(ModuleSource(trainer))
    live.replica.apply(pub.ticket(live.version, live.version, Channel.VOLUME))
    assert live.receipt(live.version) == digests and len(digests) == len(pub.table)
    assert live.engine.weight_version() == str(live.version)
    assert live.engine.greedy(support.PROMPTS, support.TOKENS) != before
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
    pub, digests = live.publish(ModuleSource(plain))
    live.replica.apply(pub.ticket(live.version, live.version, Channel.VOLUME))
    assert live.receipt(live.version) == digests
    support.assert_generates_like(live.engine, trainer)


def test_lora_merged_syncs(live: Live) -> None:
    import peft

    trainer = support.hf_trainer(live.folder, seed=3)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    lora = peft.get_peft_model(trainer, config)
    source = LoraMergedSource(lora)
    assert not any("lora" in s.name for s in source.table())
    pub, _ = live.publish(source)
    live.replica.apply(pub.ticket(live.version, live.version, Channel.VOLUME))
    merged = lora.merge_and_unload()
    support.assert_generates_like(live.engine, merged)


def test_corrupt_shard_is_refused_and_previous_version_keeps_serving(live: Live) -> None:
    serving = support.hf_trainer(live.folder, seed=4)
    pub, _ = live.publish(ModuleSource(serving))
    live.replica.apply(pub.ticket(live.version, live.version, Channel.VOLUME))

    pub, _ = live.publish(ModuleSource(support.hf_trainer(live.folder, seed=5)))
    shard = live.root / f"v{live.version:08d}" / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(
        UpdateFailed, match=r"shard-00000.safetensors of version \d+: sha256 .* tensor '.*' has changed"
    ) as err:
        live.replica.apply(pub.ticket(live.version, live.version, Channel.VOLUME))
    assert err.value.state is ReplicaState.SERVING and live.replica.state is ReplicaState.SERVING
    support.assert_generates_like(live.engine, serving)

    shard.write_bytes(bytes(data[: len(data) // 3]))  # truncated this time
    with pytest.raises(UpdateFailed, match=r"shard is truncated .* is cut off"):
        live.replica.apply(pub.ticket(live.version, live.version, Channel.VOLUME))
    support.assert_generates_like(live.engine, serving)


def test_unknown_or_unready_channel_is_refused_untouched(live: Live) -> None:
    pub, _ = live.publish(ModuleSource(support.hf_trainer(live.folder, seed=6)))
    for channel, message in [(Channel.NIXL, "no .nixl. receiver"), (Channel.CPU, "no .cpu. receiver")]:
        with pytest.raises(UpdateFailed, match=message):
            live.replica.apply(pub.ticket(live.version, live.version, channel))
        assert live.replica.state is ReplicaState.SERVING


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("extra", r"tensor 'model.layers.0.mlp.bogus.weight' was sent but the engine has no such parameter"),
        ("missing", r"parameter 'model.norm.weight' \(shape \[256\]\) is not in the version"),
        ("shape", r"tensor 'model.layers.1.mlp.down_proj.weight': shape \[256, 100\]"),
        ("dtype", r"tensor 'model.norm.weight': dtype float16, the engine holds bfloat16"),
    ],
)
def test_model_mismatch_is_refused_naming_the_tensor(live: Live, change: str, message: str) -> None:
    serving = support.hf_trainer(live.folder, seed=7)
    pub, _ = live.publish(ModuleSource(serving))
    live.replica.apply(pub.ticket(live.version, live.version, Channel.VOLUME))

    state = {n: p.detach().to(torch.bfloat16) for n, p in support.hf_trainer(live.folder, seed=8).named_parameters()}
    if change == "extra":
        state["model.layers.0.mlp.bogus.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    elif change == "missing":
        del state["model.norm.weight"]
    elif change == "shape":
        state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(256, 100, dtype=torch.bfloat16)
    else:
        state["model.norm.weight"] = state["model.norm.weight"].half()
    pub, _ = live.publish(ModuleSource(PlainModule(state), wire_dtype=None))
    with pytest.raises(UpdateFailed, match=message) as err:
        live.replica.apply(pub.ticket(live.version, live.version, Channel.VOLUME))
    assert err.value.state is ReplicaState.SERVING
    support.assert_generates_like(live.engine, serving)
