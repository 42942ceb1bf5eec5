"""Every public function on four devices, over a generated grid of layouts.

The device count is fixed when JAX starts, so the cells run in subprocesses with
`XLA_FLAGS=--xla_force_host_platform_device_count=4`: `tests/_sharding_grid.py`,
whose docstring defines the grid (mesh type x operator kind x placement of `A` x
placement of `x0` x function, with each function's options and the mesh context)
and what a cell checks (value, gradient and JVP against one device in float64,
and the documented output shardings). CI runs the pairwise-covering subset, which
holds the grid's targeted cells (the documented output shardings, the layouts that
once failed), as a step of its own; this file checks, without running a cell, that
the subset covers every pair of values of two dimensions and holds every targeted
cell. The full grid (804 cells, about eleven minutes on two cores) is run by hand
when the sharding code changes:

    python tests/_sharding_grid.py --parallel         # the subset (CI)
    python tests/_sharding_grid.py --targeted         # the targeted cells alone
    python tests/_sharding_grid.py --all --parallel   # the full grid
"""

import itertools

import _sharding_grid as grid

MAIN = ("function", "mesh", "operator", "A", "x0")


def test_shards_hold_every_function():
    assert sorted(itertools.chain(*grid.SHARDS)) == sorted(grid.FUNCTIONS)


def test_subset_covers_every_pair_of_values():
    # Every pair of values of two of the grid's dimensions that some cell of the
    # full grid has occurs in a cell of the subset (CI's step).
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


def test_subset_holds_every_targeted_cell():
    # CI's step (`--parallel`) runs the subset, so every targeted cell runs there,
    # and each once.
    subset = [grid.cell_id(c) for c in grid.grid_cells(full=False)]
    assert len(set(subset)) == len(subset)
    assert {grid.cell_id(c) for c in grid.TARGETED} <= set(subset)
