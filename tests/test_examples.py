"""Run every script in `examples/` in a subprocess, as a user would.

A script that accepts `--fast` and `--out DIR` (the convention for examples that
train something and save a figure) runs in fast mode, every other one of them with
`--out DIR`; any other script runs with no arguments. Each example runs once. Each
script asserts on its own results, so exit status 0 means the example reached its
quality target.

Running an example must not write into the repository: without `--out` a figure goes
into a new temporary folder, with `--out DIR` into `DIR`. Every run gets its own
`TMPDIR` under pytest's `tmp_path`, and the repository's `git status` and the files
of `docs/figures/` (the committed figures the docs show) must be the same after the
run as before.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def _has_fast_mode(path: pathlib.Path) -> bool:
    source = path.read_text()
    return '"--fast"' in source and '"--out"' in source


FIGURE_EXAMPLES = [p for p in EXAMPLES if _has_fast_mode(p)]


def _repository_state() -> tuple[str | None, dict[str, tuple[int, int]]]:
    """`git status` (None without git) and (size, mtime) of each committed figure."""
    status = None
    if shutil.which("git") is not None:
        result = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode == 0:
            status = result.stdout
    figures = {
        str(p.relative_to(ROOT)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted((ROOT / "docs" / "figures").glob("**/*"))
        if p.is_file()
    }
    return status, figures


def _run(path: pathlib.Path, args: list[str], tmp_path: pathlib.Path):
    """Run one example from the repository root with `TMPDIR` under `tmp_path`."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    # With XLA's default code generation: conftest.py turns the fusion emitters
    # off for the tests' own programs only. (An example may set `XLA_FLAGS` itself
    # where it is unset.)
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    flags = env.pop("XLA_FLAGS", "").split()
    flags = [f for f in flags if not f.startswith("--xla_cpu_use_fusion_emitters")]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    before = _repository_state()
    result = subprocess.run(
        [sys.executable, str(path), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, (
        f"{path.name} exited with {result.returncode}\n"
        f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    )
    after = _repository_state()
    assert after[0] == before[0], (
        f"{path.name} changed the repository's git status:\n"
        f"before:\n{before[0]}\nafter:\n{after[0]}"
    )
    assert after[1] == before[1], f"{path.name} rewrote files in docs/figures/"
    return result, tmpdir


def test_examples_are_found():
    assert EXAMPLES, f"no examples found under {ROOT / 'examples'}"
    # Both branches of the figure convention need an example each.
    assert len(FIGURE_EXAMPLES) >= 2, "fewer than two examples accept `--fast`, `--out`"


# Half the figure examples (in turn) run with `--out DIR`, the form that regenerates
# the docs' figures, the others without it: each example runs once, and both
# branches of the figure-writing convention that they all share are run.
WITH_OUT = FIGURE_EXAMPLES[::2]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path, tmp_path):
    """Fast mode, with `--out DIR` or without it; any other script without
    arguments."""
    fast = path in FIGURE_EXAMPLES
    out = tmp_path / "figures" / "nested"  # a folder that does not exist yet
    if not fast:
        args = []
    elif path in WITH_OUT:
        args = ["--fast", "--out", str(out)]
    else:
        args = ["--fast"]
    result, tmpdir = _run(path, args, tmp_path)
    if not fast:
        return
    # With `--out` the figure goes into `DIR` (created), and nothing into `TMPDIR`;
    # without it, into one new folder under `TMPDIR`.
    temporary = list(tmpdir.glob(f"krylovjax-{path.stem}-*/{path.stem}.png"))
    if path in WITH_OUT:
        figures = [out / f"{path.stem}.png"]
        assert not temporary, f"{path.name} wrote {temporary} despite `--out`"
    else:
        figures = temporary
        assert not out.exists(), f"{path.name} created {out} without `--out`"
    assert len(figures) == 1 and figures[0].is_file(), (
        f"{path.name} did not write one {path.stem}.png; {tmpdir} holds "
        f"{sorted(p.name for p in tmpdir.iterdir())}"
    )
    assert figures[0].stat().st_size > 0
    assert str(figures[0]) in result.stdout, f"{path.name} did not print its path"
