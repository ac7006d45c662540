"""The vLLM plugin asks Linux for the AMX tile state in every vLLM process it is loaded into.

Without it, vLLM 0.32's CPU attention killed the engine core with SIGILL on an AMX machine at a small first batch
(the demo's 4 prompts x 8 samples); ``make test``'s served tests reach that batch on such a machine. Here, in a fresh
process (the permission is per process and a test process may hold it already): not held before, held after
``register()``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.integration  # it loads vLLM (the plugin registers with it): about 20 s

PROBE = """
import ctypes, sys
ARCH_GET_XCOMP_PERM, XFEATURE_XTILEDATA, SYS_ARCH_PRCTL = 0x1022, 18, 158
libc = ctypes.CDLL(None, use_errno=True)
def held():
    mask = ctypes.c_uint64(0)
    assert libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) == 0, ctypes.get_errno()
    return bool(mask.value >> XFEATURE_XTILEDATA & 1)
before = held()
from weightsync_inference import plugin
plugin.register()
print(before, held())
"""


@pytest.mark.skipif(
    sys.platform != "linux" or not torch.cpu._is_amx_tile_supported(), reason="this CPU has no AMX (nothing to ask)"
)
def test_register_asks_for_the_amx_tile_state() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"], out.stdout
