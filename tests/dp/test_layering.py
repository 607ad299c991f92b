"""dp/ imports without torch (torch is an extra) and never imports fl."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_core_modules_import_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['opacus'] = None\n"
        "import dp, dp.encoding, dp.samplers, dp.budget, dp.distributed, dp.accounting\n"
        "import dp.adaptive_clip, dp.rotation\n"
        "import numpy as np\n"
        "from dp.encoding import EncodingParams, IntegerEncoder\n"
        "p = EncodingParams(dim=5, clip_norm=1.0, scale=10.0, bits=16, noise_stddev=1.0,"
        " rotation_seed=0)\n"
        "IntegerEncoder(p).encode(np.ones(5), noise=True)\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_dp_never_imports_fl() -> None:
    for path in (ROOT / "dp").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "fl" or n.startswith("fl.") for n in names), path
