"""The Python examples of the README and docs/quickstart.md run as printed: every
``print(...)  # expected`` line prints exactly what its comment says (the embedding loop,
the float encoding, and the quickstart's own model trained, saved and loaded back)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README, QUICKSTART = REPO / "README.md", REPO / "docs" / "quickstart.md"
BLOCKS = [(path, block) for path in (README, QUICKSTART)
          for block in re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"),
                                  re.S)]
CHECKED = [(p, b) for p, b in BLOCKS if re.search(r"^print\(.*\)\s+#", b, re.M)]


def test_the_readme_has_the_embedding_loop_and_the_float_encoding() -> None:
    assert any("encode(client.advertise())" in b and "server.advance()" in b
               for p, b in CHECKED if p == README)
    assert any("FixedPointCodec" in b for p, b in CHECKED if p == README)
    assert any("save_model(" in b and "load_state_dict(torch.load(" in b
               for p, b in CHECKED if p == QUICKSTART)


@pytest.mark.parametrize(("path", "block"), CHECKED,
                         ids=[f"{p.name}:{b.splitlines()[1][:30]}" for p, b in CHECKED])
def test_documented_example_prints_what_it_says(path: Path, block: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the quickstart saves its model in the working directory
    expected = [line.split("#", 1)[1].strip() for line in block.splitlines()
                if line.startswith("print(") and "#" in line]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(path), "exec"), {"__name__": "__doc_example__"})
    assert [line.strip() for line in out.getvalue().splitlines()] == expected
