"""Does NIXL (PyPI ``nixl``) import and move bytes on this host? Prints what it finds; used for docs/gpu-channels.md.

Two agents in one process, GPU 0 -> GPU 1 (or GPU 0 -> GPU 0): register buffers, exchange
metadata, one READ of 256 MiB, compare. Any failure is printed with its stage.
"""

from __future__ import annotations

import time
import traceback

import torch


def main() -> None:
    stage = "import"
    try:
        from nixl._api import nixl_agent, nixl_agent_config

        stage = "agents"
        cfg = nixl_agent_config(backends=["UCX"])
        a, b = nixl_agent("trainer", cfg), nixl_agent("engine", cfg)
        print("plugins:", a.get_plugin_list())
        dst_dev = 1 if torch.cuda.device_count() > 1 else 0
        src = torch.arange(128 << 20, dtype=torch.int16, device="cuda:0")
        dst = torch.zeros_like(src, device=f"cuda:{dst_dev}")
        stage = "register"
        a.register_memory(src)
        b.register_memory(dst)
        stage = "metadata"
        b.add_remote_agent(a.get_agent_metadata())
        stage = "transfer"
        src_desc = a.get_xfer_descs(src)
        dst_desc = b.get_xfer_descs(dst)
        t = time.perf_counter()
        handle = b.initialize_xfer("READ", dst_desc, src_desc, "trainer")
        state = b.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = b.check_xfer_state(handle)
        elapsed = time.perf_counter() - t
        equal = torch.equal(src.cpu(), dst.cpu())
        print(f"READ 256 MiB cuda:0 -> cuda:{dst_dev}: {state} in {elapsed * 1e3:.2f} ms, equal={equal}")
    except Exception:  # noqa: BLE001 - the probe reports every failure with its stage
        print(f"NIXL failed at stage {stage}:")
        traceback.print_exc()


if __name__ == "__main__":
    main()
