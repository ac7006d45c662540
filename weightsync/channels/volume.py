"""The checkpoint volume: safetensors shards plus a manifest, one directory per version.

The layout and the manifest format are in ``manifests`` (no torch: the coordinator
reads them). A version is written under a temporary name, every file and the directory are
fsync'ed, and only then is it renamed to ``vNNNNNNNN`` (atomic on POSIX), so a
reader either sees a whole version or none. Readers check every shard's size and
sha256 against the manifest before yielding a single tensor: a truncated or
altered shard is refused, naming the file and the first tensor it damages, while
the engine keeps what it had; and before that, the manifest itself is refused unless
it matches the checksum the coordinator recorded (``ticket.manifest_checksum``). The
coordinator, not the writer, prunes old versions (it knows which one is the newest
durable READY version). This is the channel of last resort and the source
for late joiners and recovery, so it favours integrity over speed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar, Self

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from weightsync.channels import digests
from weightsync.channels.base import (
    Offer,
    Placement,
    Receiver,
    Rendezvous,
    Sender,
    SenderConfig,
    SendReport,
    UpdateTicket,
    WorkerContext,
)
from weightsync.channels.manifests import MANIFEST, TEMPORARY_PREFIX, Manifest, read, version_dir
from weightsync.channels.wire import Group, check_tensor
from weightsync.errors import IntegrityError, PermanentError
from weightsync.vocabulary import Channel

DEFAULT_SHARD_BYTES = 512 << 20
_HASH_BLOCK = 16 << 20


def fsync(path: Path) -> None:
    """Flush a file's or a directory's entries to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_and_hash(path: Path) -> str:
    fsync(path)
    return _sha256_file(path)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


class VolumeSender(Sender):
    """Writes a version to the volume. ``send`` returns once it is durable and visible."""

    channel: ClassVar[Channel] = Channel.VOLUME

    def __init__(self, root: str | os.PathLike[str], shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        self.root = Path(root)
        self.shard_bytes = shard_bytes

    @classmethod
    def create(cls, config: SenderConfig) -> Self:
        if not config.root:
            raise PermanentError("volume channel: no volume root configured (the checkpoint directory)")
        return cls(config.root)

    def offer(self) -> Offer:
        return Offer(Channel.VOLUME)

    def send(self, ticket: UpdateTicket, groups: Iterable[Sequence[torch.Tensor]]) -> SendReport:
        if ticket.table is None:
            raise PermanentError(f"volume channel: the sender's ticket for v{ticket.version} has no table")
        table = ticket.table
        self.root.mkdir(parents=True, exist_ok=True)
        final = version_dir(self.root, ticket.version)
        if final.exists():
            raise PermanentError(f"{final} already exists: version {ticket.version} was published before")
        tmp = self.root / f"{TEMPORARY_PREFIX}v{ticket.version:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        shard_of: dict[str, str] = {}
        shards: dict[str, tuple[int, str]] = {}
        found: dict[str, str] = {}
        pending: dict[str, torch.Tensor] = {}
        pending_bytes = 0
        hashing = ThreadPoolExecutor(max_workers=2)
        futures = []
        # A version may be laid out for another reader: one file under a fixed name plus side
        # files (a PEFT adapter folder: adapter_model.safetensors + adapter_config.json).
        single, files = ticket.shard_name, ticket.files
        if MANIFEST in (single, *files):
            raise PermanentError(f"volume file name {MANIFEST!r} is the manifest's; name the shard or file otherwise")
        shard_limit = float("inf") if single else self.shard_bytes

        def flush() -> None:
            nonlocal pending, pending_bytes
            if not pending:
                return
            name = single or f"shard-{len(shards):05d}.safetensors"
            path = tmp / name
            # save_file serialises straight to the file (the in-memory `save` costs a second
            # copy); the hash reads it back from the page cache while the next shard is written
            try:
                save_file(pending, str(path))
            except SafetensorError as e:  # an I/O failure (a full volume) surfaces as safetensors' own error
                raise OSError(f"{path}: {e}") from e
            shards[name] = (path.stat().st_size, "")
            futures.append((name, hashing.submit(_fsync_and_hash, path)))
            pending, pending_bytes = {}, 0

        try:
            for specs, tensors in zip(table.groups(), groups, strict=True):
                if len(specs) != len(tensors):
                    raise PermanentError(
                        f"group starting at {specs[0].name!r}: {len(tensors)} tensors, expected {len(specs)}"
                    )
                for spec, tensor in zip(specs, tensors, strict=True):
                    check_tensor(spec, tensor)
                    t = tensor.detach().contiguous().cpu()
                    if ticket.verify:
                        found[spec.name] = digests.digest(t)
                    pending[spec.name] = t
                    shard_of[spec.name] = single or f"shard-{len(shards):05d}.safetensors"
                    pending_bytes += spec.nbytes
                    if pending_bytes >= shard_limit:
                        flush()
            flush()
            for name, fut in futures:
                shards[name] = (shards[name][0], fut.result())
            manifest = Manifest(
                ticket.version,
                ticket.step,
                table.with_digests(found) if found else table,
                shard_of,
                shards,
                time.time(),
            )
            for fname, text in files.items():
                with (tmp / fname).open("w") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
            with (tmp / MANIFEST).open("w") as f:
                f.write(manifest.to_json())
                f.flush()
                os.fsync(f.fileno())
            fsync(tmp)
            os.rename(tmp, final)
            fsync(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            hashing.shutdown(wait=True)
        return SendReport(found)


def _name_damaged_tensor(path: Path, size: int, manifest: Manifest, file: str) -> str:
    """Best effort: the first tensor in a damaged shard that is cut off or whose digest changed."""
    names = [n for n, f in manifest.shard_of.items() if f == file] or [
        manifest.table.tensors[p.tensor].name for p in manifest.pieces if p.file == file
    ]
    try:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        data_start = 8 + header_len
        for name in names:
            end = data_start + header[name]["data_offsets"][1]
            if end > size:
                return f"tensor {name!r} is cut off at byte {size} of {end}"
        expected = manifest.table.digests()
        with safe_open(str(path), framework="pt") as st:
            for name in names:
                if name in expected and digests.digest(st.get_tensor(name)) != expected[name]:
                    return f"tensor {name!r} has changed"
    except Exception:  # noqa: BLE001 - the shard is already known bad; naming is a courtesy
        pass
    return f"it holds tensors {names[:3]!r}{'...' if len(names) > 3 else ''}"


def verify_version(directory: Path, manifest: Manifest) -> None:
    """Check every shard's size and sha256 against the manifest; raise naming the file and tensor."""

    def check(item: tuple[str, tuple[int, str]]) -> None:
        file, (size, sha) = item
        path = directory / file
        # the bare file name and version survive where a server masks paths (vLLM answers with "<path>")
        what = f"{path}: {file} of version {manifest.version}"
        if not path.is_file():
            raise IntegrityError(f"{what}: shard is missing; the version is refused")
        actual = path.stat().st_size
        if actual != size:
            where = _name_damaged_tensor(path, actual, manifest, file)
            raise IntegrityError(
                f"{what}: shard is truncated ({actual} of {size} bytes): {where}; the version is refused"
            )
        got = _sha256_file(path)
        if got != sha:
            where = _name_damaged_tensor(path, actual, manifest, file)
            raise IntegrityError(
                f"{what}: sha256 {got} does not match the manifest's {sha}: {where}; the version is refused"
            )

    with ThreadPoolExecutor(max_workers=2) as pool:
        for _ in pool.map(check, manifest.shards.items()):
            pass


class VolumeReceiver(Receiver):
    """Reads a version from the volume after verifying all of it (manifest checksum, then every shard)."""

    channel: ClassVar[Channel] = Channel.VOLUME
    needs = ("root",)

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root else None
        self.begin()

    def version_directory(self, ticket: UpdateTicket) -> Path:
        root = ticket.root or self.root
        if root is None:
            raise PermanentError("volume channel: no volume root in the ticket or the receiver")
        return version_dir(Path(root), ticket.version)

    @classmethod
    def from_rendezvous(cls, rendezvous: Rendezvous, ctx: WorkerContext) -> VolumeReceiver:
        return cls(root=rendezvous.root)

    def manifest(self, ticket: UpdateTicket) -> Manifest:
        """The version's manifest, checked against the ticket's manifest checksum."""
        return read(self.version_directory(ticket), ticket.version, ticket.manifest_checksum)

    def receive(self, ticket: UpdateTicket, place: Placement | None = None) -> Iterator[Group]:
        self.begin()
        directory = self.version_directory(ticket)
        manifest = self.manifest(ticket)
        self.table = ticket.resolve_table(manifest.table, f"{directory}")
        verify_version(directory, manifest)  # every file, before a byte reaches the engine
        if manifest.sharded:
            yield from self._receive_sharded(ticket, directory, manifest)
            return
        expected = manifest.table.digests()
        if ticket.verify and len(expected) != len(manifest.table):
            raise IntegrityError(
                f"{directory}: version {ticket.version} must be verified, but its manifest has digests for "
                f"{len(expected)} of {len(manifest.table)} tensors (written with verification off); "
                "the version is refused"
            )
        handles: dict[str, Any] = {}
        try:
            for specs in manifest.table.groups():
                group: Group = []
                for spec in specs:
                    file = manifest.shard_of[spec.name]
                    if file not in handles:
                        handles[file] = safe_open(str(directory / file), framework="pt").__enter__()  # type: ignore[no-untyped-call]
                    group.append((spec, handles[file].get_tensor(spec.name)))
                if ticket.verify and expected:
                    self.check(group, expected)
                yield group
        finally:
            for h in handles.values():
                h.__exit__(None, None, None)

    def _receive_sharded(self, ticket: UpdateTicket, directory: Path, manifest: Manifest) -> Iterator[Group]:
        """A sharded version (format v2) read whole, the gathered way (a replica without a recorded layout): each
        tensor assembled from every rank's pieces, every tile checked against its digest as it is read (the rank
        files' sha256 were checked before: nothing is loaded from a damaged version); the digests acked are those
        of the assembled tensors, what the trainer's live stream would have sent."""
        from weightsync.channels.volume_regions import RegionReader
        from weightsync.sharding.boxes import Box

        reader = RegionReader(directory, manifest)
        index = {spec.name: i for i, spec in enumerate(manifest.table)}
        try:
            for specs in manifest.table.groups():
                group: Group = [(spec, reader.region(index[spec.name], Box.whole(spec.shape))) for spec in specs]
                if ticket.verify:
                    self.check(group, {})  # the tiles were checked; this records what the engine acks
                yield group
        finally:
            reader.close()


SENDER = VolumeSender
RECEIVER = VolumeReceiver
