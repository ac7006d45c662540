from __future__ import annotations

import pytest

from weightsync.errors import ModelMismatchError, PermanentError
from weightsync.tensors import ALIGNMENT, TensorSpec, TensorTable
from weightsync.vocabulary import Channel, VersionState

pytestmark = pytest.mark.unit


def _table() -> TensorTable:
    return TensorTable.build(
        [[("embed", "bfloat16", (10, 4))], [("l0.w", "float32", (3, 3)), ("l0.b", "float32", (3,))]]
    )


def test_build_aligns_offsets_and_groups() -> None:
    t = _table()
    assert [s.offset % ALIGNMENT for s in t] == [0, 0, 0]
    assert [len(g) for g in t.groups()] == [1, 2]
    assert t.total_bytes == 80 + 36 + 12
    assert TensorTable.from_dict(t.to_dict()) == t


def test_spec_rejects_bad_fields_naming_them() -> None:
    with pytest.raises(PermanentError, match="tensor 'x': dtype 'complex64' is not supported"):
        TensorSpec("x", "complex64", (1,))
    with pytest.raises(PermanentError, match="offset 3 must be"):
        TensorSpec("x", "float32", (1,), offset=3)
    with pytest.raises(PermanentError, match="lacks field 'dtype'"):
        TensorSpec.from_dict({"name": "x", "shape": [1]})


def test_check_matches_names_the_tensor() -> None:
    t = _table()
    missing = TensorTable.build([[("embed", "bfloat16", (10, 4))]])
    with pytest.raises(ModelMismatchError, match=r"tensor 'l0.w' .* is expected but was not sent"):
        missing.check_matches(t)
    extra = TensorTable.build([[(s.name, s.dtype, s.shape) for s in t] + [("l9.w", "float32", (1,))]])
    with pytest.raises(ModelMismatchError, match=r"tensor 'l9.w' was sent but the receiver has no such tensor"):
        extra.check_matches(t)
    shape = TensorTable.build(
        [[("embed", "bfloat16", (10, 5))], [("l0.w", "float32", (3, 3)), ("l0.b", "float32", (3,))]]
    )
    with pytest.raises(ModelMismatchError, match=r"tensor 'embed': received dtype bfloat16 shape \[10, 5\], expected"):
        shape.check_matches(t)
    dtype = TensorTable.build(
        [[("embed", "float16", (10, 4))], [("l0.w", "float32", (3, 3)), ("l0.b", "float32", (3,))]]
    )
    with pytest.raises(ModelMismatchError, match="received dtype float16"):
        dtype.check_matches(t)


def test_duplicate_names_rejected() -> None:
    with pytest.raises(ModelMismatchError, match="appears twice"):
        TensorTable.build([[("a", "float32", (1,)), ("a", "float32", (1,))]])


def test_vocabulary() -> None:
    assert Channel.parse("weightsync-volume") is Channel.VOLUME
    assert Channel.CPU.engine_name == "weightsync-cpu"
    with pytest.raises(
        ValueError, match="unknown channel 'carrier-pigeon'; valid channels: ipc, nccl, nixl, cpu, volume"
    ):
        Channel.parse("carrier-pigeon")
    assert VersionState.SUPERSEDED.phase == "Superseded"
