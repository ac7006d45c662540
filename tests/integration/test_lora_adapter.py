"""LoRA adapters as adapter weights: published to the volume as a PEFT folder, served by a real vLLM engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests import support
from weightsync.channels import manifests
from weightsync.channels.volume import VolumeSender
from weightsync.errors import IntegrityError
from weightsync.tensors import manifest_checksum
from weightsync.vocabulary import Channel
from weightsync_inference.adapters import AdapterSlot
from weightsync_trainer import reference
from weightsync_trainer.publisher import publish_adapter
from weightsync_trainer.sources import LoraAdapterSource

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine() -> Iterator[object]:
    from weightsync_inference.offline import OfflineEngine

    e = OfflineEngine(support.tiny_model(), Channel.VOLUME, memory_fraction=0.05, enable_lora=True, max_lora_rank=8)
    yield e
    e.close()


def _lora_model(seed: int) -> torch.nn.Module:
    import peft

    torch.manual_seed(seed)
    base = support.hf_trainer(support.tiny_model(), seed=0, steps=0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    reference.train_step(model, opt, 512, seed=seed)
    return model


def _checksum(root: Path, version: int) -> str:
    """The manifest checksum the coordinator records when the adapter version becomes durable."""
    return manifest_checksum(manifests.manifest_path(root, version).read_bytes())


def test_adapter_versions_load_verified_and_generate_like_peft(engine: object, tmp_path: Path) -> None:
    slot = AdapterSlot()
    base = engine.greedy(support.PROMPTS, support.TOKENS)  # type: ignore[attr-defined]
    for version in (1, 2):
        model = _lora_model(seed=version)
        source = LoraAdapterSource(model)
        assert all(".lora_A." in s.name or ".lora_B." in s.name for s in source.table())
        report = publish_adapter(source, VolumeSender(tmp_path), version, step=version)
        assert not report.failed and len(report.digests) == len(source.table())
        assert sorted(p.name for p in manifests.version_dir(tmp_path, version).iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
            "manifest.json",
        ]  # a PEFT folder vLLM's LoRA loader takes as it is
        adapter = slot.apply(tmp_path, version, _checksum(tmp_path, version))
        assert adapter.digests == report.digests and len(adapter.digests) == 2 * 3 * 2  # A,B x 3 modules x 2 layers
        got = engine.greedy(support.PROMPTS, support.TOKENS, lora_request=slot.request())  # type: ignore[attr-defined]
        assert got != base
        result = reference.agreement(model, support.PROMPTS, got, support.LOGPROB_TOLERANCE)
        assert result.ok, result.mismatches

    # a damaged adapter is refused; the slot keeps serving version 2
    publish_adapter(LoraAdapterSource(_lora_model(seed=3)), VolumeSender(tmp_path), 3, step=3)
    checksum = _checksum(tmp_path, 3)
    data = (tmp_path / "v00000003" / "adapter_model.safetensors").read_bytes()
    (tmp_path / "v00000003" / "adapter_model.safetensors").write_bytes(data[:-64])
    with pytest.raises(IntegrityError, match=r"adapter_model.safetensors of version 3: shard is truncated"):
        slot.apply(tmp_path, 3, checksum)
    assert slot.current is not None and slot.current.version == 2

    # so is an intact adapter whose manifest is not the one the coordinator recorded
    with pytest.raises(IntegrityError, match=r"manifest checksum .* is not the .* the coordinator recorded"):
        slot.apply(tmp_path, 2, "sha256:" + "0" * 64)
    assert slot.current is not None and slot.current.version == 2
