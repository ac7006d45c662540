"""The checkpoint volume: safetensors shards plus a manifest, one directory per version.

Layout under the volume root::

    v00000007/manifest.json           version, step, tensors (shard, dtype, shape, digest), shards (sha256)
    v00000007/shard-00000.safetensors

A version is written under a temporary name, every file and the directory are
fsync'ed, and only then is it renamed to ``vNNNNNNNN`` (atomic on POSIX), so a
reader either sees a whole version or none. Readers check every shard's size and
sha256 against the manifest before yielding a single tensor: a truncated or
altered shard is refused, naming the file and the first tensor it damages, while
the engine keeps what it had. This is the channel of last resort and the source
for late joiners and recovery, so it favours integrity over speed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from weightsync.channels import digests
from weightsync.channels.base import (
    Group,
    Receiver,
    Sender,
    UpdateTicket,
    WorkerContext,
    check_tensor,
    verify_group,
)
from weightsync.errors import IntegrityError, PermanentError
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel

FORMAT = "weightsync.volume/v1"
MANIFEST = "manifest.json"
DEFAULT_SHARD_BYTES = 512 << 20
_HASH_BLOCK = 16 << 20


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:08d}"


def _fsync(path: Path) -> None:
    """Flush a file's or a directory's entries to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_and_hash(path: Path) -> str:
    _fsync(path)
    return _sha256_file(path)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class Manifest:
    version: int
    step: int
    table: TensorTable
    shard_of: dict[str, str]
    shards: dict[str, tuple[int, str]]  # file -> (bytes, sha256)
    created: float

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "version": self.version,
                "step": self.step,
                "created": self.created,
                "total_bytes": self.table.total_bytes,
                "group_starts": list(self.table.group_starts),
                "tensors": [dict(s.to_dict(), shard=self.shard_of[s.name]) for s in self.table],
                "shards": [{"file": f, "bytes": b, "sha256": h} for f, (b, h) in self.shards.items()],
            },
            indent=1,
        )

    @classmethod
    def load(cls, directory: Path) -> Manifest:
        path = directory / MANIFEST
        try:
            raw: dict[str, Any] = json.loads(path.read_text())
        except FileNotFoundError:
            raise IntegrityError(f"{path}: no manifest; the version was never completed") from None
        except json.JSONDecodeError as e:
            raise IntegrityError(f"{path}: manifest is not valid JSON ({e})") from None
        if raw.get("format") != FORMAT:
            raise PermanentError(f"{path}: format {raw.get('format')!r}, expected {FORMAT!r}")
        table = TensorTable.from_dict({"tensors": raw["tensors"], "group_starts": raw.get("group_starts", [0])})
        return cls(
            version=int(raw["version"]),
            step=int(raw["step"]),
            table=table,
            shard_of={t["name"]: t["shard"] for t in raw["tensors"]},
            shards={s["file"]: (int(s["bytes"]), s["sha256"]) for s in raw["shards"]},
            created=float(raw.get("created", 0.0)),
        )


def list_versions(root: Path) -> list[int]:
    """Complete versions on the volume (those with a manifest), oldest first."""
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if p.name.startswith("v") and p.name[1:].isdigit() and (p / MANIFEST).is_file():
            out.append(int(p.name[1:]))
    return sorted(out)


def latest_version(root: Path) -> int | None:
    versions = list_versions(root)
    return versions[-1] if versions else None


def prune(root: Path, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` versions (and stale temporaries); return what was deleted."""
    if keep < 1:
        raise PermanentError(f"retention must keep at least 1 version, got {keep}")
    versions = list_versions(root)
    doomed = versions[:-keep]
    for v in doomed:
        shutil.rmtree(version_dir(root, v), ignore_errors=True)
    for tmp in root.glob(".tmp-*"):
        if time.time() - tmp.stat().st_mtime > 3600:
            shutil.rmtree(tmp, ignore_errors=True)
    return doomed


class VolumeSender(Sender):
    """Writes a version to the volume. ``send`` returns once it is durable and visible."""

    channel: ClassVar[Channel] = Channel.VOLUME

    def __init__(self, root: str | os.PathLike[str], shard_bytes: int = DEFAULT_SHARD_BYTES, keep: int = 3) -> None:
        self.root = Path(root)
        self.shard_bytes = shard_bytes
        self.keep = keep

    def send(self, ticket: UpdateTicket, groups: Iterable[Sequence[torch.Tensor]]) -> dict[str, str]:
        self.root.mkdir(parents=True, exist_ok=True)
        final = version_dir(self.root, ticket.version)
        if final.exists():
            raise PermanentError(f"{final} already exists: version {ticket.version} was published before")
        tmp = self.root / f".tmp-v{ticket.version:08d}-{os.getpid()}"
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
        single = str(ticket.params.get("shard_name", ""))
        files = {str(k): str(v) for k, v in dict(ticket.params.get("files", {})).items()}
        for fname in [single, *files]:
            if fname and (Path(fname).name != fname or fname == MANIFEST):
                raise PermanentError(f"volume file name {fname!r} must be a plain name other than {MANIFEST}")
        shard_limit = float("inf") if single else self.shard_bytes

        def flush() -> None:
            nonlocal pending, pending_bytes
            if not pending:
                return
            name = single or f"shard-{len(shards):05d}.safetensors"
            path = tmp / name
            # save_file serialises straight to the file (the in-memory `save` costs a second
            # copy); the hash reads it back from the page cache while the next shard is written
            save_file(pending, str(path))
            shards[name] = (path.stat().st_size, "")
            futures.append((name, hashing.submit(_fsync_and_hash, path)))
            pending, pending_bytes = {}, 0

        try:
            for specs, tensors in zip(ticket.table.groups(), groups, strict=True):
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
                ticket.table.with_digests(found) if found else ticket.table,
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
            _fsync(tmp)
            os.rename(tmp, final)
            _fsync(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            hashing.shutdown(wait=True)
        prune(self.root, self.keep)
        return found


def _name_damaged_tensor(path: Path, size: int, manifest: Manifest, file: str) -> str:
    """Best effort: the first tensor in a damaged shard that is cut off or whose digest changed."""
    names = [n for n, f in manifest.shard_of.items() if f == file]
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
    """Reads a version from the volume after verifying all of it."""

    channel: ClassVar[Channel] = Channel.VOLUME

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root else None
        self.verified = {}

    def _directory(self, ticket: UpdateTicket) -> Path:
        root = ticket.params.get("root") or self.root
        if root is None:
            raise PermanentError("volume channel: no volume root in the ticket's params or the receiver")
        return version_dir(Path(root), ticket.version)

    @classmethod
    def from_init(cls, init: Mapping[str, Any], ctx: WorkerContext) -> VolumeReceiver:
        """``init_info``: root (the volume's mount path; a ticket may name another)."""
        return cls(root=init.get("root"))

    def receive(self, ticket: UpdateTicket, destinations: Mapping[str, torch.Tensor] | None = None) -> Iterator[Group]:
        self.verified = {}
        directory = self._directory(ticket)
        manifest = Manifest.load(directory)
        if manifest.version != ticket.version:
            raise IntegrityError(f"{directory}: manifest says version {manifest.version}, expected {ticket.version}")
        if len(ticket.table):
            manifest.table.check_matches(ticket.table)
        verify_version(directory, manifest)
        self.table = manifest.table
        expected = manifest.table.digests()
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
                    self.verified.update(verify_group(group, expected))
                yield group
        finally:
            for h in handles.values():
                h.__exit__(None, None, None)

    def manifest(self, ticket: UpdateTicket) -> Manifest:
        return Manifest.load(self._directory(ticket))


SENDER = VolumeSender
RECEIVER = VolumeReceiver
