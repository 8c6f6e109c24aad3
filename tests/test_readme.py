"""The README's promises a user runs first: every Python block of the README and docs/ runs on a CPU as printed,
each in a fresh interpreter, and the README's test command is the one .ci/run runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks() -> list[tuple[str, str]]:
    blocks = []
    for document in DOCUMENTS:
        for i, code in enumerate(re.findall(r"```python\n(.*?)```", document.read_text(), re.S)):
            blocks.append((f"{document.relative_to(ROOT)}#{i}", code))
    return blocks


@pytest.mark.slow
@pytest.mark.parametrize("name,code", python_blocks(), ids=[name for name, _ in python_blocks()])
def test_each_python_block_runs_on_a_cpu_as_printed(name, code, tmp_path):
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
                            timeout=600)
    assert result.returncode == 0, f"{name} failed:\n{result.stderr[-3000:]}"


def test_the_readme_test_command_is_the_one_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    setup = re.search(r"^pip install -q (torch==\S+ --extra-index-url https://download.pytorch.org/whl/cpu && pip install)"
                      r" -q (-e \"\.\[test\]\" && pip install) -q (--no-deps \"flashinfer-python[^\"]+\")$", ci, re.M)
    tests = re.search(r"^python -m pytest (-q -rs)$", ci, re.M)
    assert setup and tests, "the set-up or test line of .ci/run changed shape: update this test and the README"
    command = f"pip install {setup[1]} {setup[2]} {setup[3]} && python -m pytest {tests[1]}"
    assert command in readme, f"the README's command 2 is not .ci/run's: {command}"
    extra = re.search(r"^    (flashinfer-python\S+)$", (ROOT / "setup.cfg").read_text(), re.M)[1]
    assert f'"{extra}"' in setup[3], "the tests bind the newest FlashInfer the [flashinfer] extra resolves to"
