"""What an engine worker reports about itself and its last update: plain data across vLLM's process boundaries.

The agent never acks a value it was handed: it acks the ``Receipt`` the engine's own
weight-transfer engine wrote while it loaded the version (the per-tensor digests it
computed where the bytes landed, how each tensor got into the model, the time per
phase), read back through vLLM's ``collective_rpc`` (one receipt per worker). A failed
update's receipt says whether bytes reached the parameters (``torn``): a field, not a
phrase to search for in an error message.

``Identity`` is what a worker is: its rank in the replica, its device and GPU UUID,
whether NIXL is importable there. The agent registers the replica with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from weightsync.errors import IntegrityError, PermanentError, WeightsyncError
from weightsync.tensors import TensorTable, content_digest
from weightsync.vocabulary import Channel, SyncPhase


@dataclass(frozen=True)
class Identity:
    rank: int
    world_size: int
    device: str
    gpu_uuid: str = ""
    nixl: bool = False
    peers: tuple[str, ...] = ()
    """The other GPUs this worker reads peer-to-peer (``channels.gpu.peers``)."""

    @property
    def gpu(self) -> bool:
        return self.device.startswith("cuda")

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Identity:
        try:
            peers = tuple(str(u) for u in d.get("peers", ()))
            return cls(
                int(d["rank"]), int(d["world_size"]), str(d["device"]), str(d["gpu_uuid"]), bool(d["nixl"]), peers
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PermanentError(f"engine worker identity {dict(d)!r} is malformed: {e}") from None


def read_by_every(workers: Sequence[Identity]) -> tuple[str, ...]:
    """The GPUs every worker of a replica reads directly, its own or a peer (``Capabilities.peer_gpu_uuids``): a
    trainer rank on one is a link each worker copies."""
    if not workers:
        return ()
    return tuple(sorted(set.intersection(*({w.gpu_uuid, *w.peers} for w in workers))))


@dataclass(frozen=True)
class Receipt:
    """One worker's record of its last update (``version`` 0: none yet)."""

    version: int = 0
    channel: Channel | None = None
    ok: bool = True
    torn: bool = False
    """A failed update left bytes in the parameters: the replica must stay paused until a whole version loads."""
    layout_digest: str = ""
    digests: Mapping[str, str] = field(default_factory=dict)
    """Per-tensor digests the engine computed where the bytes landed (verification on)."""
    in_place: tuple[str, ...] = ()
    """Tensors received straight into the engine's parameters."""
    loader: tuple[str, ...] = ()
    """Tensors that went through vLLM's weight loaders (layouts that cannot be written in place)."""
    seconds: Mapping[SyncPhase, float] = field(default_factory=dict)
    error: str = ""

    @property
    def content_digest(self) -> str:
        return content_digest(self.digests) if self.digests else ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "channel": self.channel.value if self.channel else "",
            "ok": self.ok,
            "torn": self.torn,
            "layout_digest": self.layout_digest,
            "digests": dict(self.digests),
            "in_place": list(self.in_place),
            "loader": list(self.loader),
            "seconds": {p.value: s for p, s in self.seconds.items()},
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Receipt:
        try:
            return cls(
                version=int(d["version"]),
                channel=Channel.parse(str(d["channel"])) if d.get("channel") else None,
                ok=bool(d["ok"]),
                torn=bool(d["torn"]),
                layout_digest=str(d.get("layout_digest", "")),
                digests={str(k): str(v) for k, v in dict(d.get("digests", {})).items()},
                in_place=tuple(str(x) for x in d.get("in_place", [])),
                loader=tuple(str(x) for x in d.get("loader", [])),
                seconds={SyncPhase(k): float(v) for k, v in dict(d.get("seconds", {})).items()},
                error=str(d.get("error", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PermanentError(f"engine receipt is malformed ({type(e).__name__}: {e})") from None


def merge(receipts: Sequence[Receipt]) -> Receipt:
    """One replica's receipt from its workers' (tensor-parallel ranks each receive the whole version).

    Torn if any worker is, or if one finished the version another failed (the replica would hold a mix: each
    worker records its failure rather than raising it, so the others finish); failed if any failed; the digests
    must agree across workers.
    """
    if not receipts:
        raise PermanentError("the engine returned no receipt (no worker answered)")
    first = receipts[0]
    for other in receipts[1:]:
        if other.version != first.version:
            raise IntegrityError(f"engine workers report versions {first.version} and {other.version}")
        if first.ok and other.ok and other.digests and other.digests != first.digests:
            raise IntegrityError(f"engine workers computed different digests for version {first.version}")
    failed = next((r for r in receipts if not r.ok), None)
    if failed is None:
        return first
    return Receipt(
        failed.version,
        failed.channel,
        ok=False,
        torn=any(r.torn or (r.ok and r.version == failed.version) for r in receipts),
        layout_digest=failed.layout_digest,
        error=failed.error,
    )


def last_table(answers: Sequence[Mapping[str, Any]]) -> TensorTable | None:
    """The table the workers last received whole (``WorkerExtension.weightsync_table``): the same on every worker
    (each receives every tensor on the gathered path), None before any."""
    tables = [TensorTable.from_dict(a["table"]) for a in answers if a.get("table")]
    if not tables or len(tables) != len(answers):
        return None
    digests = {t.layout_digest() for t in tables}
    if len(digests) != 1:
        raise IntegrityError(f"engine workers last received different tables ({sorted(digests)})")
    return tables[0]


def regions_answers(replies: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The workers' replies to ``weightsync_receive_regions``; ``WeightsyncError`` naming every worker that failed
    (whether it was left torn is its receipt's to say).

    A worker answers its failure instead of raising it: vLLM 0.32's multiprocess executor stops reading replies at
    the first worker that raised, so the others' replies stayed queued and the engine's next call (the receipt, a
    recovery's load) read a stale one; a trainer rank that dies mid-send fails every worker at once."""
    failed = [r for r in replies if "error" in r]
    if failed:
        raise WeightsyncError("; ".join(f"worker {r.get('worker')}: {r['error']}" for r in failed))
    return [dict(r) for r in replies]
