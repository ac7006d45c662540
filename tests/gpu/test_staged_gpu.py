"""Staged mode on real GPUs: a version streamed over NCCL into a replica's stage while its parameters keep serving
the previous one, then switched into the same parameter addresses, bit-exact; a CUDA graph captured before the
switch computes with the new weights after it (the addresses it recorded hold them).

The trainer's sender (GPU 0) and the replica's updater (GPU 1, vLLM's Qwen3 layout, the harness model) run in one
process, one thread each (``bench/staged_switch.StagedPair``, also what the switch benchmark times).
"""

from __future__ import annotations

import pytest
import torch

from bench.staged_switch import StagedPair

pytestmark = pytest.mark.gpu


def test_staged_switch_lands_in_the_same_parameters_bit_exact() -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices (the trainer on one, the replica on the other)")
    pair = StagedPair("qwen3-tiny", "cuda:0", "cuda:1", verify=True)
    engine = torch.device("cuda:1")
    params = pair.model.params
    qkv = params["model.layers.1.self_attn.qkv_proj.weight"]
    addresses = {name: p.data_ptr() for name, p in params.items()}
    with torch.cuda.device(engine):
        out = torch.zeros((), device=engine)
        warm = torch.cuda.Stream(engine)
        with torch.cuda.stream(warm):  # graphs are captured after a warm-up on a side stream
            out.copy_(qkv.float().sum())
        torch.cuda.current_stream(engine).wait_stream(warm)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(qkv.float().sum())
    try:
        for version, verify in ((1, True), (2, False)):
            pair.verify = verify
            serving = pair.model.digests(pair.table)
            sent = pair.stage(version)
            assert pair.model.digests(pair.table) == serving and not pair.updater.torn  # still the old weights
            receipt = pair.switch(version)
            assert receipt.ok and receipt.version == version
            assert set(receipt.in_place) == {s.name for s in pair.table} and not receipt.loader
            assert pair.model.digests(pair.table) == sent
            if verify:
                assert dict(receipt.digests) == sent  # checked again where the switch put them
            assert {name: p.data_ptr() for name, p in params.items()} == addresses
            graph.replay()
            torch.cuda.synchronize(engine)
            assert torch.equal(out, qkv.float().sum())
    finally:
        pair.close()
