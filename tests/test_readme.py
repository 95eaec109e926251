"""The README's usage example runs as written."""

from __future__ import annotations

from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = README.read_text()
    start = text.index("```python\n", text.index("## Using the manager")) + len("```python\n")
    code = text[start : text.index("```", start)]
    exec(compile(code, str(README), "exec"), {})
    assert "[0 1 2]" in capsys.readouterr().out


def test_readme_host_memory_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = README.read_text()
    start = text.index("```python\n", text.index("## Host memory")) + len("```python\n")
    code = text[start : text.index("```", start)]
    exec(compile(code, str(README), "exec"), {})
    assert capsys.readouterr().out.startswith(("pageable", "page-locked", "cuda-registered"))
