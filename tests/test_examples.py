"""Run every script in `examples/` in a subprocess, as a user would.

A script that accepts `--fast` and `--out DIR` (the convention for examples that
train something and save a figure) runs in fast mode with its figure written to a
temporary folder, which must then hold a PNG named after the script; any other
script runs with no arguments. Each script asserts on its own results, so exit
status 0 means the example reached its quality target.
"""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def _has_fast_mode(path: pathlib.Path) -> bool:
    source = path.read_text()
    return '"--fast"' in source and '"--out"' in source


def test_examples_are_found():
    assert EXAMPLES, f"no examples found under {ROOT / 'examples'}"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path, tmp_path):
    fast = _has_fast_mode(path)
    command = [sys.executable, str(path)]
    if fast:
        command += ["--fast", "--out", str(tmp_path)]
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, (
        f"{path.name} exited with {result.returncode}\n"
        f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    )
    if fast:
        figure = tmp_path / f"{path.stem}.png"
        assert figure.is_file(), f"{path.name} did not write {figure.name}"
        assert figure.stat().st_size > 0
