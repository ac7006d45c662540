"""LoRA adapters published by the trainer, served by vLLM next to unchanged base weights.

An adapter version is a checkpoint-volume version laid out as a PEFT folder. Before the
engine sees it, the whole version is verified exactly like a full one (every file's
sha256 against the manifest, every tensor's digest against the trainer's), so a damaged
adapter is refused and the previous one keeps serving. vLLM then loads it under a new
adapter id per version: requests move to the new adapter atomically, never to a mix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from weightsync.channels.base import UpdateTicket
from weightsync.channels.manifests import version_dir
from weightsync.channels.volume import VolumeReceiver
from weightsync.vocabulary import Channel


@dataclass(frozen=True)
class Adapter:
    version: int
    path: Path
    digests: dict[str, str]

    @property
    def name(self) -> str:
        return f"weightsync-v{self.version}"


def verify_adapter(root: Path, version: int, manifest_checksum: str = "") -> Adapter:
    """Check the adapter version whole (manifest checksum, files and tensor digests); raise naming what is damaged."""
    receiver = VolumeReceiver(root)
    for _group in receiver.receive(UpdateTicket(version, Channel.VOLUME, manifest_checksum=manifest_checksum)):
        pass
    return Adapter(version, version_dir(root, version), dict(receiver.verified))


class AdapterSlot:
    """The adapter a replica serves: replaced only by a verified newer version."""

    def __init__(self) -> None:
        self.current: Adapter | None = None

    def apply(self, root: Path, version: int, manifest_checksum: str = "") -> Adapter:
        """Verify ``version`` (against the coordinator's ``manifest_checksum`` when given), then serve it."""
        adapter = verify_adapter(root, version, manifest_checksum)  # raises before anything changes
        self.current = adapter
        return adapter

    def request(self) -> object | None:
        """vLLM's ``LoRARequest`` for the current adapter (a new id per version), or None."""
        if self.current is None:
            return None
        from vllm.lora.request import LoRARequest

        request: object = LoRARequest(self.current.name, self.current.version, str(self.current.path))
        return request
