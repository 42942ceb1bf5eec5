"""Every public function on four devices, over a generated grid of layouts.

The device count is fixed when JAX starts, so the cells run in subprocesses with
`XLA_FLAGS=--xla_force_host_platform_device_count=4`: `tests/_sharding_grid.py`,
whose docstring defines the grid (mesh type x operator kind x placement of `A` x
placement of `x0` x function, with each function's options and the mesh context)
and what a cell checks (value, gradient and JVP against one device in float64,
and the documented output shardings). The suite runs the grid's targeted cells
(the documented output shardings, the layouts that once failed), in two processes at
once, and checks that the pairwise-covering subset covers every pair of values of two
dimensions; CI runs that subset as a step of its own, and the full grid (656 cells,
about ten minutes on two cores) is run by hand when the sharding code changes:

    python tests/_sharding_grid.py --parallel         # the subset (CI)
    python tests/_sharding_grid.py --all --parallel   # the full grid
"""

import itertools
import json
import os
import pathlib
import subprocess
import sys

import _sharding_grid as grid

SCRIPT = pathlib.Path(__file__).with_name("_sharding_grid.py")
MAIN = ("function", "mesh", "operator", "A", "x0")


def _run_shards() -> list[dict]:
    """The records of every shard of the subset, the shards run at once (each is
    one process on one core)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={grid.DEVICES}"
    env["JAX_PLATFORMS"] = "cpu"
    runs = [
        subprocess.Popen(
            [
                sys.executable,
                str(SCRIPT),
                "--targeted",
                "--json",
                "--shard",
                str(shard),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for shard in range(len(grid.SHARDS))
    ]
    records = []
    for run in runs:
        stdout, stderr = run.communicate(timeout=900)
        records += json.loads(stdout.strip().splitlines()[-1])["records"]
        assert run.returncode in (0, 1), stderr[-4000:]
    return records


def test_shards_hold_every_function():
    assert sorted(itertools.chain(*grid.SHARDS)) == sorted(grid.FUNCTIONS)


def test_subset_covers_every_pair_of_values():
    # Every pair of values of two of the grid's dimensions that some cell of the
    # full grid has occurs in a cell of the suite's subset.
    def pairs(cells):
        return {
            (a, c[a], b, c[b])
            for c in cells
            for a, b in itertools.combinations(MAIN, 2)
        }

    full = grid.grid_cells(full=True)
    assert len({tuple(c[k] for k in MAIN) for c in full}) == sum(
        len(grid.MESHES)
        * len(s["operators"])
        * len(grid.A_LAYOUTS)
        * len(grid.X_LAYOUTS)
        for s in grid.FUNCTIONS.values()
    )
    assert pairs(full) - pairs(grid.grid_cells(full=False)) == set()


def test_targeted_cells_match_one_device():
    records = _run_shards()
    # Every generated cell reported, once.
    want = sorted(grid.cell_id(c) for c in grid.TARGETED)
    assert sorted(r["id"] for r in records) == want
    failed = {r["id"]: r["problems"] for r in records if r["problems"]}
    assert failed == {}, json.dumps(failed, indent=1)
