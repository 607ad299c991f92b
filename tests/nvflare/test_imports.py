"""The NVFlare runtime is its own extra: it imports neither flwr nor torch (a site whose
training script uses another framework installs neither)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("nvflare.apis")  # not the namespace of tests/nvflare/ itself

BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("flwr", "torch"):
            raise ImportError(f"{name} is blocked")
sys.meta_path.insert(0, Block())
import fl.nvflare.client, fl.nvflare.job, fl.nvflare.server
print("ok")
"""


def test_the_nvflare_runtime_imports_neither_flwr_nor_torch() -> None:
    out = subprocess.run([sys.executable, "-c", BLOCK], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"
