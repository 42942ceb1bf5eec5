"""Every public function on four forced host devices, over a generated grid of layouts.

CI runs the subset as a step of its own, in subprocesses (the device count is
fixed when JAX starts); `tests/test_sharding.py` checks the subset's cover without
running a cell, and the full grid is run by hand:

    python tests/_sharding_grid.py --parallel        # exit status 1 on a failure
    python tests/_sharding_grid.py --all --parallel  # the full grid
    python tests/_sharding_grid.py --shard 0 --json  # half the subset, as JSON

(`--parallel` runs the two halves, `SHARDS`, in two processes at once; `--list`
prints the cells, `--function` and `--only` select some.)

**The grid.** A cell is one choice from each dimension:

- `mesh`: a 1-D mesh of the four devices with axis `"x"`, of type `Auto` or
  `Explicit`;
- `operator`: how `A` is given: `"dense"` (the matrix `S`), `"bcoo"` (a
  `jax.experimental.sparse.BCOO` matrix), `"closure"` (`lambda v: S @ v`) or
  `"module"` (an `equinox.Module` holding `S`);
- `A`: how the operator's arrays are placed: `"replicated"` (`P()`), `"rows"`
  (`P("x", None)`) or `"columns"` (`P(None, "x")`). For a BCOO matrix, whose
  arrays are its stored entries, `"rows"` and `"columns"` split the entries over
  the devices (values `P("x")`, indices `P("x", None)`), sorted by row or by
  column, so that each device holds the entries of its block of rows or of
  columns;
- `x0`: the starting vector, `"replicated"` (`(n,)`, `P()`), `"rows"` (`(n,)`,
  `P("x")`) or `"block"` (`(n, b)`, split along `b`: `P(None, "x")`);
- `function`: `krylov`, `chebyshev` (`krylov` with
  `basis=krylovjax.Chebyshev(-3, 3)`), `readout` (`krylov_readout` and
  `polynomial_action`), `iterate`, `arnoldi`, `lanczos`,
  `funm_action`, `trace_funm`, `block_funm`, and the layers `nn.KrylovGraphConv`,
  `nn.LinearDynamics` and `nn.StateSpaceConv` (`graph_conv`, `linear_dynamics`,
  `state_space`), and `spectrum` (`spectrum_interval`);

and, beside those, `context` (the call made inside `jax.set_mesh(mesh)`, or
outside any mesh context with the arrays placed by `NamedSharding(mesh, ...)`)
and each function's own options (`FUNCTIONS`: the method, the adjoint, the
layout). Where a dimension does not apply as stated, the cell uses the nearest
equivalent:

- `iterate`: the step applies the operator: `"closure"` is `lambda x: S @ x`,
  `"module"` a Module holding `S`, `"dense"` the nonlinear step
  `lambda x: jnp.tanh(S @ x)`, and `"bcoo"` `lambda x: jnp.tanh(M @ x)` with JAX's
  own product for the BCOO matrix `M`;
- `arnoldi`, `lanczos`, `funm_action` take one vector: a `"block"` `x0` is a
  batch of `b` starting vectors, `jax.vmap` over its columns (split over the
  devices). `funm_action` takes `jnp.exp` with Lanczos and a polynomial of the
  small matrix with Arnoldi (a matrix function: `expm` compiles three times
  slower), with a fixed depth or with `tol=1e-8` (its value: the report has no
  derivative);
- `trace_funm` draws its probes from a key: `x0` is the probes' layout, and the
  probes are drawn replicated; `"rows"` passes `like=` an array of one probe's
  shape split by rows (the probes take its dtype only), and `"block"` estimates
  `b` traces at once, `jax.vmap` over `b` keys split over the devices, and
  then, where `A` is replicated, also the gradient for each key
  (`"grad_per_key"`, a `vmap` of `jax.grad`). No derivative with respect to
  `x0`. Each estimator (and Hutchinson's with its probes in one block, and in
  batches) runs with the fewest probes it takes (`ESTIMATOR_OPTIONS`), and is
  compared with itself on one device;
- `spectrum`: `spectrum_interval(method="lanczos")` from a key, and for a
  matrix (dense or BCOO) also `method="gershgorin"`; `x0` is the key's layout as
  for `trace_funm` (`"block"`: a `jax.vmap` over `b` keys split over the
  devices; `"rows"` as `"replicated"`). The interval has no derivative: its
  gradient and JVP are compared as zeros;
- `block_funm`: `funm_action` of a block `x0` of shape `(n, b)` as one problem
  (block Lanczos with `jnp.exp`, block Arnoldi with the polynomial), at depth
  `n / b` where its block Krylov space fills everything, or
  (`method="trace"`) `trace_funm(jnp.exp, ..., num_probes=b, block_size=b / 2)`,
  which reads no `x0`. Its `x0` is always a block: `"replicated"` (`P()`),
  `"rows"` (`P("x", None)`) or `"block"` (split along `b`);
- `graph_conv`: `A` is the adjacency (dense or BCOO; the layer takes no
  callable) and `x0` the node features `X` of shape `(n, f)`, replicated, by rows
  (`P("x", None)`) or by feature columns (`P(None, "x")`); the layer's weights
  are replicated;
- `linear_dynamics`: `A` is the layer's transition matrix (dense only) and `x0`
  its initial state; a `"block"` is a batch of states, `jax.vmap` over columns;
- `state_space`: `A` is the pair of `(n, n)` matrices that parameterise the state
  matrix (dense only) and `x0` the input sequence `(L, c)`: replicated, by time
  steps (`P("x", None)`) or by channels (`P(None, "x")`).

Combinations that do not exist are not generated: a layer with a callable
operator, and the forward mode of the reverse-only `adjoint="custom_vjp"`. A
block has `b = 4` columns, the smallest that four devices split.

**A cell** runs one program under `jax.jit` that computes the value, the gradient
of `sum(sin(value))` with respect to every differentiable array (the operator's,
`x0`, a layer's parameters) and a JVP along a fixed random tangent (symmetric for
the matrix, whose decompositions assume it); only when that program fails are the
three run one at a time, to name the failing mode. A `closed` cell's program
closes over its vectors instead of taking them as arguments (so it computes the
value and the gradient with respect to the other arrays), and a `gathered`
cell's loss reads each output through a gather of its rows. Each is compared
with the same function on one device, in float64: the largest difference
relative to the largest entry must be below `RTOL`. The reference is computed
once per function and `x0` shape, with the function's first options and the
dense matrix (every operator kind holds the same matrix; the gradient of a BCOO
matrix's stored values is the dense gradient at their positions), and a block of
independent problems is assembled from the program for one vector. A cell
passes, or fails in a mode with a documented error (`DOCUMENTED`: a `ValueError`
raised by krylovjax that names what to change), or is a known failure of JAX
itself (`KNOWN`, each with the reason); any other error, a difference, or a
sharding that breaks a documented guarantee (`problems`) fails it.

**The subset.** The full grid is every combination of the five dimensions, with
the context and each function's options chosen so that every pair of values of
any two of a function's dimensions occurs. The subset (what CI runs, `--parallel`)
is the `TARGETED` cells (output shardings, doubling's two reverse-pass schemes,
arrays placed on no mesh, programs that close over split vectors or read their
output through a gather of rows, layouts that once failed) and, added greedily and
deterministically (`cover`), cells until every pair of values of two of the five
dimensions and the context occurs, and every option's value with every mesh type
(`krylov`'s and `iterate`'s options with every dimension). `--targeted` runs
the `TARGETED` cells alone.

Sizes are tiny (`N`, `D`, `B`): a cell costs its compilation, which is why the
programs are compiled with most XLA optimisations off (a fifth faster), the
references too.
"""

import argparse
import functools
import itertools
import json
import os
import re
import subprocess
import sys
import time
import traceback

if __name__ == "__main__":
    # Before JAX starts; imported by the tests, the module changes nothing.
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import sparse  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import krylovjax  # noqa: E402
from krylovjax import nn  # noqa: E402

N, D, B = 8, 3, 4
RTOL = 1e-10
DEVICES = 4

MESHES = ("auto", "explicit")
OPERATORS = ("dense", "bcoo", "closure", "module")
A_LAYOUTS = ("replicated", "rows", "columns")
X_LAYOUTS = ("replicated", "rows", "block")
CONTEXTS = ("outside", "inside")
MAIN = ("mesh", "operator", "A", "x0")

# Each function: the operator kinds it takes, its own options (each a dimension of
# its cells; the first value of each is the reference's), and which of its options
# pair with every dimension in the subset (the others pair with `mesh` only).
KRYLOV_METHODS = (
    "scan/custom_jvp",
    "scan/custom_vjp",
    "scan/autodiff",
    "doubling/custom_vjp",
    "doubling/autodiff",
)
DECOMPOSITION_ADJOINTS = ("custom_jvp", "autodiff")
# `trace_funm`'s estimators, each with the fewest probes it takes: Hutch++ a sketch
# of one vector, its basis and one remainder probe; Krylov-aware a sketch of one
# vector and one remainder probe; Hutchinson also with its probes in one block
# (block Lanczos), and in batches (a full batch of two and a remainder of one, run
# under `jax.checkpoint`).
ESTIMATOR_OPTIONS = {
    "hutchinson": dict(num_probes=1),
    "hutchinson/block": dict(num_probes=2, block_size=2),
    "hutchinson/batches": dict(num_probes=3, probes_per_batch=2),
    "hutch++": dict(estimator="hutch++", num_probes=3, num_sketch=1),
    "krylov-aware": dict(estimator="krylov-aware", num_probes=2, num_sketch=1),
}
ESTIMATORS = tuple(ESTIMATOR_OPTIONS)
FUNCTIONS: dict[str, dict] = {
    "krylov": dict(
        operators=OPERATORS,
        options=dict(method=KRYLOV_METHODS, layout=("columns", "rows")),
        paired=("method", "layout"),
    ),
    # `krylov` in a polynomial basis (`basis=krylovjax.Chebyshev(-3, 3)`).
    "chebyshev": dict(
        operators=OPERATORS,
        options=dict(adjoint=("custom_jvp", "autodiff"), layout=("columns", "rows")),
    ),
    "iterate": dict(
        operators=OPERATORS,
        options=dict(adjoint=("custom_jvp", "custom_vjp", "autodiff")),
        paired=("adjoint",),
    ),
    # `krylov_readout` with a (2, n) `C` and `polynomial_action` with d
    # coefficients, in the monomial basis or `Chebyshev(-3, 3)`, keeping one
    # vector in the reverse pass (`checkpoints`: 1, a binomial schedule) or, by
    # default, every vector ("default").
    "readout": dict(
        operators=OPERATORS,
        options=dict(basis=("monomial", "chebyshev"), checkpoints=("1", "default")),
    ),
    "linear_dynamics": dict(operators=("dense",), options={}),
    "graph_conv": dict(operators=("dense", "bcoo"), options={}),
    "state_space": dict(operators=("dense",), options={}),
    "arnoldi": dict(operators=OPERATORS, options=dict(adjoint=DECOMPOSITION_ADJOINTS)),
    "lanczos": dict(operators=OPERATORS, options=dict(adjoint=DECOMPOSITION_ADJOINTS)),
    "funm_action": dict(
        operators=OPERATORS,
        options=dict(
            method=("lanczos", "arnoldi"),
            adjoint=DECOMPOSITION_ADJOINTS,
            # "none" for `tol=None`: a dimension's value is never None (unset).
            tol=("none", 1e-8),
        ),
    ),
    "trace_funm": dict(
        operators=OPERATORS,
        options=dict(adjoint=DECOMPOSITION_ADJOINTS, estimator=ESTIMATORS),
    ),
    # `funm_action` of a block `x0` (block Lanczos or Arnoldi, one basis for the
    # `B` columns), and `trace_funm(block_size=2)`.
    "block_funm": dict(
        operators=OPERATORS, options=dict(method=("lanczos", "arnoldi", "trace"))
    ),
    # `spectrum_interval` by Lanczos, and by Gershgorin for a matrix.
    "spectrum": dict(operators=OPERATORS, options={}),
}


def _dimensions(function: str) -> list[tuple[str, tuple]]:
    """The dimensions of a function's cells: the main ones, the context, and its
    options (named `function.option`, so that no two functions share one)."""
    spec = FUNCTIONS[function]
    dims = [
        ("function", (function,)),
        ("mesh", MESHES),
        ("operator", spec["operators"]),
        ("A", A_LAYOUTS),
        ("x0", X_LAYOUTS),
        ("context", CONTEXTS),
    ]
    return dims + [(f"{function}.{k}", tuple(v)) for k, v in spec["options"].items()]


def _required(function: str, full: bool) -> set:
    """The pairs of values that the cells of `function` must cover: every pair of
    dimensions in the full grid; in the subset every pair of the main dimensions
    and the context, and of each option with the mesh (with every dimension for
    the options in `paired`)."""
    dims = _dimensions(function)
    paired = {f"{function}.{k}" for k in FUNCTIONS[function].get("paired", ())}
    main = {"function", "mesh", "operator", "A", "x0", "context"}
    out = set()
    for (a, va), (b, vb) in itertools.combinations(dims, 2):
        if not (full or {a, b} <= main or "mesh" in (a, b) or {a, b} & paired):
            continue
        out |= {(a, x, b, y) for x in va for y in vb}
    return out


def _pairs(row: dict) -> set:
    names = [name for name in row if row[name] is not None]
    return {(a, row[a], b, row[b]) for a, b in itertools.combinations(names, 2)}


def _fill(function: str, seed: dict, todo: set) -> dict:
    """A row of `function` from `seed`: each free dimension, in order, takes the
    first value that covers the most pairs of `todo`."""
    row = {name: seed.get(name) for name, _ in _dimensions(function)}
    row["function"] = function
    for name, values in _dimensions(function):
        if row[name] is None:
            row[name] = max(
                values, key=lambda v, name=name: len(_pairs({**row, name: v}) & todo)
            )
    return row


def _fits(function: str, pair: tuple) -> bool:
    dims = dict(_dimensions(function))
    a, x, b, y = pair
    return a in dims and b in dims and x in dims[a] and y in dims[b]


def cover(full: bool, seeds: list[dict] = ()) -> list[dict]:
    """Rows (dicts of dimension values) covering the required pairs of every
    function (`_required`), greedily and deterministically: `seeds` count first;
    then, while a pair is left, a row is built around the first of them, for the
    first function (cheapest first) whose row covers the most pairs left. The full
    grid (`full`) starts from every combination of the main dimensions."""
    todo = set().union(*(_required(f, full) for f in FUNCTIONS))
    rows = []
    for seed in seeds:
        todo -= _pairs(seed)
    if full:
        for function, spec in FUNCTIONS.items():
            main = itertools.product(MESHES, spec["operators"], A_LAYOUTS, X_LAYOUTS)
            for values in main:
                seed = dict(zip(("mesh", "operator", "A", "x0"), values, strict=True))
                rows.append(_fill(function, seed, todo))
                todo -= _pairs(rows[-1])
    while todo:
        pair = min(todo, key=str)
        a, x, b, y = pair
        candidates = [_fill(f, {a: x, b: y}, todo) for f in FUNCTIONS if _fits(f, pair)]
        rows.append(max(candidates, key=lambda row: len(_pairs(row) & todo)))
        todo -= _pairs(rows[-1])
    return rows


def as_cell(row: dict) -> dict:
    """A row of `cover` as a cell: its options gathered under `"options"`."""
    function = row["function"]
    options = {k: row[f"{function}.{k}"] for k in FUNCTIONS[function]["options"]}
    cell = {k: v for k, v in row.items() if "." not in k}
    return dict(cell, options=options)


def _row(cell: dict) -> dict:
    row = {k: v for k, v in cell.items() if k in ("function", *MAIN, "context")}
    row.update({f"{cell['function']}.{k}": v for k, v in cell["options"].items()})
    return row


def cell_id(cell: dict) -> str:
    keys = ("function", *MAIN, "context")
    parts = [f"{k}={cell[k]}" for k in keys]
    parts += [f"{k}={v}" for k, v in sorted(cell["options"].items())]
    if cell.get("size"):
        parts.append("n={}-d={}".format(*cell["size"]))
    if cell.get("unplaced"):
        parts.append(f"unplaced={cell['unplaced']}")
    if cell.get("closed"):
        parts.append("closed")
    if cell.get("gathered"):
        parts.append("gathered")
    if cell.get("auto_table"):
        parts.append("auto_table")
    return ",".join(parts)


def _cell(function, mesh, operator, A, x0, context="outside", **extra):
    options = {k: v[0] for k, v in FUNCTIONS[function]["options"].items()}
    options.update(extra.pop("options", {}))
    return dict(
        function=function,
        mesh=mesh,
        operator=operator,
        A=A,
        x0=x0,
        context=context,
        options=options,
        **extra,
    )


def _krylov(mesh, A, x0, method, layout, **extra):
    return _cell(
        "krylov",
        mesh,
        extra.pop("operator", "dense"),
        A,
        x0,
        options=dict(method=method, layout=layout),
        **extra,
    )


# Cells the subset always holds: guarantees beyond values and derivatives, and the
# layouts that once failed. They count towards the subset's pairs.
TARGETED = (
    # The output shardings that docs/multi_device.md tabulates for an `Auto` mesh:
    # the two common layouts, both output layouts, every method and adjoint with
    # a row-sharded matrix, one of each method with a split block.
    # (The table depends on the layouts, not the method: every method once, and
    # the rows layout with the default.)
    *(
        _krylov("auto", A, x0, method, layout, auto_table=True)
        for A, x0, methods in (
            ("rows", "replicated", KRYLOV_METHODS),
            ("replicated", "block", ("scan/custom_jvp", "doubling/custom_vjp")),
        )
        for method in methods
        for layout in ("columns", "rows")
        if layout == "columns" or method == "scan/custom_jvp"
    ),
    # Doubling's reverse pass transposes its levels when the powers of A fit in
    # memory and runs a Hillis-Steele scan otherwise; at (N, D) it transposes.
    # These sizes take the scan, with a row-sharded A and with a split block.
    *(
        _krylov(mesh, A, x0, "doubling/custom_vjp", "columns", size=size)
        for mesh in MESHES
        for A, x0, size in (
            ("rows", "replicated", (16, 6)),
            ("replicated", "block", (64, 5)),
        )
    ),
    # Arrays placed on no mesh beside arrays on an explicit one (replicated on it).
    *(
        _krylov(
            "explicit",
            A,
            x0,
            "scan/custom_jvp",
            "columns",
            operator=operator,
            context=context,
            unplaced=unplaced,
        )
        for operator, contexts in (
            ("dense", CONTEXTS),
            ("closure", CONTEXTS[::-1]),
            ("bcoo", CONTEXTS),
        )
        for (A, x0, unplaced), context in zip(
            (("rows", "replicated", "x0"), ("replicated", "rows", "A")),
            contexts,
            strict=True,
        )
    ),
    # A callable operator in the decompositions on an explicit mesh (a closure for
    # the decompositions, a Module for the functions built on them).
    *(
        _cell(function, "explicit", operator, "rows", x0)
        for functions, operator, x0 in (
            (("arnoldi", "lanczos"), "closure", "rows"),
            (("funm_action", "trace_funm"), "module", "replicated"),
        )
        for function in functions
    ),
    # `funm_action(tol=...)` inside `jax.set_mesh` on an explicit mesh: the stop
    # test's functions, made before the decomposition, are called in its region
    # with every axis `Auto`.
    *(
        _cell(
            "funm_action",
            "explicit",
            "dense",
            "rows",
            "rows",
            context="inside",
            options={"tol": 1e-8, "method": method},
        )
        for method in ("lanczos", "arnoldi")
    ),
    # A block split by rows (`"block_rows"`, `P("x", None)`, beyond the grid's x0
    # layouts): the graph layout, stored entries and node features split by rows,
    # called outside a mesh; and a row-sharded matrix, where the reverse pass's
    # product with A contracts an axis that both operands shard.
    *(
        _krylov(mesh, "rows", "block_rows", method, "columns", operator=operator)
        for mesh, operator, method in (
            ("auto", "bcoo", "scan/custom_jvp"),
            ("explicit", "bcoo", "scan/custom_jvp"),
            ("explicit", "bcoo", "scan/autodiff"),
            *(("explicit", "dense", method) for method in KRYLOV_METHODS[:2]),
            ("explicit", "closure", "scan/custom_jvp"),
            # A callable's block is flattened for doubling's matrix.
            ("explicit", "module", "doubling/custom_vjp"),
        )
    ),
    # A block on an explicit mesh, called outside `jax.set_mesh`: the example
    # eigenvalues that `f` is closure-converted on once lacked the mesh in their
    # type.
    *(
        _cell("block_funm", "explicit", "dense", "replicated", "replicated", options=o)
        for o in ({"method": "lanczos"}, {"method": "trace"})
    ),
    # A matrix on no mesh under a `vmap` over vectors or keys split over an
    # explicit mesh (for keys, with the gradient for each key). Fresh arrays on no
    # mesh did not join the split ones: zeros joined to a decomposition's numbers
    # (Arnoldi's visible block, the steps of a stopped run), scatters into zeros
    # (the Krylov-aware block Krylov basis, block Lanczos's tridiagonal matrix),
    # and the matrix's cotangent, resharded back onto no mesh under the `vmap`.
    *(
        _cell(
            function,
            "explicit",
            "dense",
            "replicated",
            "block",
            options=options,
            unplaced="A",
        )
        for function, options in (
            ("arnoldi", {}),
            ("lanczos", {}),
            *(
                ("funm_action", {"method": method, "tol": tol})
                for method in ("lanczos", "arnoldi")
                for tol in ("none", 1e-8)
            ),
            *(("trace_funm", {"estimator": e}) for e in ESTIMATORS),
            ("trace_funm", {"estimator": "hutchinson", "tol": 1e-6}),
        )
    ),
    # Vectors split by rows on an explicit mesh, in programs that close over them
    # (`closed`: concrete arrays enter the trace as constants, and `zeros_like`
    # of one is typed replicated, where the loops' results are typed split) or
    # whose loss reads the output through a gather of its rows (`gathered`, as
    # `GraphPartition.from_partitioned` does: the output's cotangent arrives
    # replicated).
    *(
        _cell(function, "explicit", operator, "replicated", "rows", **extra)
        for function, operator, extra in (
            ("krylov", "dense", {"closed": True}),
            ("chebyshev", "dense", {"closed": True}),
            ("readout", "bcoo", {"gathered": True, "context": "inside"}),
            ("readout", "dense", {"closed": True, "gathered": True}),
            ("graph_conv", "bcoo", {"closed": True, "gathered": True}),
            ("iterate", "closure", {"closed": True}),
            ("lanczos", "dense", {"closed": True}),
            ("funm_action", "dense", {"closed": True}),
            ("block_funm", "dense", {"closed": True}),
        )
    ),
)


def grid_cells(full: bool) -> list[dict]:
    """The full grid (`full`), or the subset and the `TARGETED` cells."""
    if full:
        return [as_cell(row) for row in cover(True)]
    plain = [
        c
        for c in TARGETED
        if not c.get("size")
        and not c.get("unplaced")
        and not c.get("closed")
        and not c.get("gathered")
        and c["x0"] in X_LAYOUTS
    ]
    seeds = [_row(c) for c in plain]
    return list(TARGETED) + [as_cell(row) for row in cover(False, seeds)]


# ----------------------------------------------------------------- the problems


class Linear(eqx.Module):
    """x -> S x, as an Equinox module."""

    weight: jax.Array

    def __call__(self, x):
        return self.weight @ x


def _polynomial(H):
    """A matrix function of the small matrix, for `funm_action`'s Arnoldi path."""
    return H + H @ H / 2


def _symmetric(rng, n, scale):
    G = rng.standard_normal((n, n))
    return (G + G.T) * (scale / np.sqrt(2 * n))


def _mask(n):
    """A symmetric sparsity pattern with a number of entries divisible by 4."""
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    return (np.abs(i - j) <= 1) | ((i + j) % 3 == 0)


class Problem:
    """The arrays of one (function, operator, x0 shape), in a canonical order.

    `arrays` maps names to NumPy arrays; `diff` names those differentiated;
    `kinds` says how each is placed (`"A"`: like the operator, `"entries"`: a BCOO
    entry array, `"x0"`: like x0, `"keys"`, or `"replicated"`); `apply(arrays,
    options)` is the function of the cell; `tangent` holds a tangent per
    differentiable array."""

    def __init__(self, function, operator, x_kind, size):
        n, d = size
        self.n, self.d = n, d
        self.function, self.operator, self.x_kind = function, operator, x_kind
        rng = np.random.default_rng(0)
        mask = _mask(n)
        S = _symmetric(rng, n, 1.0) * mask
        T = _symmetric(rng, n, 1.0) * mask
        rows, cols = np.nonzero(mask)  # sorted by row
        self.arrays, self.kinds, self.tangent = {}, {}, {}
        if operator == "bcoo":
            self._add("data", S[rows, cols], "entries", T[rows, cols])
            self._add("indices", np.stack([rows, cols], 1).astype(np.int32), "entries")
        elif function not in ("linear_dynamics", "state_space"):
            self._add("S", S, "A", T)
        x_shape = (n, B) if x_kind == "block" else (n,)
        if function in ("trace_funm", "spectrum"):
            keys = jax.random.split(jax.random.key(0), B)
            if x_kind == "block":
                self._add("keys", np.asarray(jax.random.key_data(keys)), "keys")
            else:
                self._add("key", np.asarray(jax.random.key_data(keys[0])), "key")
            if x_kind == "like":
                self._add("like", np.zeros(n), "x0")
        elif function == "graph_conv":
            self._add(
                "X", rng.standard_normal((n, B)), "x0", rng.standard_normal((n, B))
            )
            layer = nn.KrylovGraphConv(B, 2, d - 1, key=jax.random.key(1))
            self._add(
                "weight",
                np.asarray(layer.weight),
                "replicated",
                rng.standard_normal(layer.weight.shape),
            )
            self._add(
                "bias",
                np.asarray(layer.bias),
                "replicated",
                rng.standard_normal(layer.bias.shape),
            )
            self.layer = layer
        elif function == "readout":
            self._add(
                "x0", rng.standard_normal(x_shape), "x0", rng.standard_normal(x_shape)
            )
            self._add("C", rng.standard_normal((2, n)), "replicated", T[:2])
            self._add("theta", rng.standard_normal(d), "replicated", T[0, :d])
        elif function == "linear_dynamics":
            layer = nn.LinearDynamics(n, d, learn_x0=False, key=jax.random.key(1))
            self._add("S", np.asarray(layer.transition), "A", T)
            self._add(
                "x0", rng.standard_normal(x_shape), "x0", rng.standard_normal(x_shape)
            )
            self.layer = layer
        elif function == "state_space":
            layer = nn.StateSpaceConv(n, B, 2, n, key=jax.random.key(1))
            self._add("skew", np.asarray(layer.skew), "A", T)
            self._add("damping", np.asarray(layer.damping), "A", T.T)
            self._add(
                "x0", rng.standard_normal((n, B)), "x0", rng.standard_normal((n, B))
            )
            self.layer = layer
        else:
            self._add(
                "x0", rng.standard_normal(x_shape), "x0", rng.standard_normal(x_shape)
            )

    def _add(self, name, value, kind, tangent=None):
        self.arrays[name] = value
        self.kinds[name] = kind
        if tangent is not None:
            self.tangent[name] = np.asarray(tangent, dtype=value.dtype)

    @property
    def diff(self):
        return tuple(self.tangent)

    def operator_of(self, a):
        """The operator `A` of the cell, from its arrays."""
        n = self.n
        if self.operator == "bcoo":
            return sparse.BCOO((a["data"], a["indices"]), shape=(n, n))
        S = a["S"]
        if self.function == "iterate":
            if self.operator == "closure":
                return lambda x: S @ x
            if self.operator == "module":
                return Linear(S)
            return lambda x: jnp.tanh(S @ x)
        if self.operator == "dense":
            return S
        if self.operator == "closure":
            return lambda v: S @ v
        return Linear(S)

    def apply(self, a, options):
        f, d = self.function, self.d
        if f == "krylov":
            method, adjoint = options["method"].split("/")
            return krylovjax.krylov(
                self.operator_of(a),
                a["x0"],
                d,
                method=method,
                adjoint=adjoint,
                layout=options["layout"],
            )
        if f == "chebyshev":
            return krylovjax.krylov(
                self.operator_of(a),
                a["x0"],
                d,
                basis=krylovjax.Chebyshev(-3.0, 3.0),
                adjoint=options["adjoint"],
                layout=options["layout"],
            )
        if f == "readout":
            A = self.operator_of(a)
            basis = None
            if options["basis"] == "chebyshev":
                basis = krylovjax.Chebyshev(-3.0, 3.0)
            kept = options["checkpoints"]
            kept = None if kept == "default" else int(kept)
            y = krylovjax.krylov_readout(
                A, a["x0"], d, a["C"], basis=basis, checkpoints=kept
            )
            z = krylovjax.polynomial_action(
                A, a["x0"], a["theta"], basis=basis, checkpoints=kept
            )
            return y, z
        if f == "iterate":
            step = self.operator_of(a)
            if self.operator == "bcoo":
                M = step
                step = lambda x: jnp.tanh(M @ x)  # noqa: E731
            return krylovjax.iterate(step, a["x0"], d, adjoint=options["adjoint"])
        if f in ("arnoldi", "lanczos", "funm_action"):
            A = self.operator_of(a)

            tol = None if options.get("tol", "none") == "none" else options["tol"]

            def one(x0):
                if f == "funm_action":
                    # A scalar function for Lanczos, a matrix function for Arnoldi
                    # (a polynomial: `expm` compiles three times slower).
                    fn = jnp.exp if options["method"] == "lanczos" else _polynomial
                    out = krylovjax.funm_action(
                        fn,
                        A,
                        x0,
                        d,
                        method=options["method"],
                        adjoint=options["adjoint"],
                        tol=tol,
                    )
                    # With a tolerance, the value (the report has no derivative).
                    return out if tol is None else out[0]
                return getattr(krylovjax, f)(A, x0, d, adjoint=options["adjoint"])

            x0 = a["x0"]
            return jax.vmap(one, in_axes=1)(x0) if x0.ndim == 2 else one(x0)
        if f == "block_funm":
            # Depth 2: the block Krylov space of B columns fills all N = 2 B.
            A, depth = self.operator_of(a), self.n // B
            if options["method"] == "trace":
                key = jax.random.key(0)
                like = jax.ShapeDtypeStruct((self.n,), jnp.float64)
                return krylovjax.trace_funm(
                    jnp.exp, A, key, depth, num_probes=B, block_size=B // 2, like=like
                )
            fn = jnp.exp if options["method"] == "lanczos" else _polynomial
            return krylovjax.funm_action(
                fn, A, a["x0"], depth, method=options["method"]
            )
        if f == "trace_funm":
            A = self.operator_of(a)
            like = a.get("like", jax.ShapeDtypeStruct((self.n,), jnp.float64))

            # `tol` in the targeted cells only (not a dimension of the grid).
            tol = options.get("tol")

            def estimate(key):
                return krylovjax.trace_funm(
                    jnp.exp,
                    A,
                    key,
                    d,
                    like=like,
                    adjoint=options["adjoint"],
                    tol=tol,
                    **ESTIMATOR_OPTIONS[options["estimator"]],
                )

            if "keys" in a:
                return jax.vmap(estimate)(jax.random.wrap_key_data(a["keys"]))
            return estimate(jax.random.wrap_key_data(a["key"]))
        if f == "spectrum":
            A = self.operator_of(a)
            matrix = self.operator in ("dense", "bcoo")
            sizes = {} if matrix else dict(n=self.n, dtype=jnp.float64)

            def interval(key):
                out = krylovjax.spectrum_interval(
                    A, method="lanczos", key=key, d=d, **sizes
                )
                return (*out, *krylovjax.spectrum_interval(A)) if matrix else out

            if "keys" in a:
                return jax.vmap(interval)(jax.random.wrap_key_data(a["keys"]))
            return interval(jax.random.wrap_key_data(a["key"]))
        if f == "graph_conv":
            layer = eqx.tree_at(
                lambda m: (m.weight, m.bias), self.layer, (a["weight"], a["bias"])
            )
            return layer(self.operator_of(a), a["X"])
        if f == "linear_dynamics":
            layer = eqx.tree_at(lambda m: m.transition, self.layer, a["S"])
            x0 = a["x0"]
            return jax.vmap(layer, in_axes=1)(x0) if x0.ndim == 2 else layer(x0)
        layer = eqx.tree_at(
            lambda m: (m.skew, m.damping), self.layer, (a["skew"], a["damping"])
        )
        return layer(a["x0"])


@functools.cache
def problem(function, operator, x_kind, size=(N, D)) -> Problem:
    return Problem(function, operator, x_kind, size)


def _x_kind(cell):
    """What the problem's arrays depend on in the `x0` layout: their shapes."""
    block = cell["x0"] in ("block", "block_rows")
    if cell["function"] in ("graph_conv", "state_space", "block_funm") or block:
        return "block"
    if cell["function"] == "trace_funm" and cell["x0"] == "rows":
        return "like"
    return "vector"


def _spec_of(kind, cell, ndim):
    """The PartitionSpec of an array of `kind` in `cell`."""
    if kind == "A":
        specs = {"replicated": P(), "rows": P("x", None), "columns": P(None, "x")}
        return specs[cell["A"]]
    if kind == "entries":
        return P() if cell["A"] == "replicated" else P("x", *(None,) * (ndim - 1))
    if kind == "keys":
        return P("x", None)
    if kind == "key":
        return P()
    if kind == "x0":
        if cell["x0"] == "replicated":
            return P()
        if cell["x0"] in ("rows", "block_rows"):
            return P("x", *(None,) * (ndim - 1))
        return P(None, "x")
    return P()


def _order(cell, prob):
    """The permutation of the stored entries in the cell (sorted by column for a
    BCOO matrix split by columns), or None."""
    if prob.operator != "bcoo" or cell["A"] != "columns":
        return None
    rows, cols = prob.arrays["indices"].T
    return np.lexsort((rows, cols))


# ------------------------------------------------------------------ the programs


def _loss(out, gathered=False):
    # Nonlinear: the gradient reads the value (a linear loss's gradient with
    # respect to `x0` would not, and JAX then drops `x0` from the program).
    # `gathered`: each leaf read through a gather of its first axis, reversed (the
    # same loss: a sum over the entries).
    leaves = jax.tree.leaves(out)
    if gathered:
        leaves = [_reversed_rows(leaf) for leaf in leaves]
    return sum(jnp.sum(jnp.sin(leaf)) for leaf in leaves)


def _reversed_rows(x):
    """`x`'s first axis reversed by a gather, replicated on an explicit mesh (as
    `GraphPartition.from_partitioned` reads its rows)."""
    sharding = jax.typeof(x).sharding
    explicit = getattr(sharding.mesh, "are_all_axes_explicit", False)
    out = sharding.update(spec=P()) if explicit else None
    rows = jnp.arange(x.shape[0])[::-1]
    return x.at[rows].get(unique_indices=True, out_sharding=out)


def _program(prob, options, modes, closed=None, gathered=False):
    """The jitted program computing `modes` ("value", "grad", "jvp", and for a
    `vmap` over keys "grad_per_key", the gradient for each key) at once; it
    closes over the arrays `closed` (a dict), and reads its loss through a
    gather with `gathered`."""
    closed = closed or {}

    def run(diff, rest, tangent):
        def f(diff):
            return prob.apply({**diff, **rest, **closed}, options)

        def per_key(key):
            one = {k: v for k, v in rest.items() if k != "keys"}

            def loss(diff):
                return _loss(prob.apply({**diff, **one, "key": key}, options))

            return jax.grad(loss)(diff)

        out = {}
        if "value" in modes:
            out["value"] = f(diff)
        if "grad" in modes:
            out["grad"] = jax.grad(lambda diff: _loss(f(diff), gathered))(diff)
        if "jvp" in modes:
            out["jvp"] = jax.jvp(f, (diff,), (tangent,))[1]
        if "grad_per_key" in modes:
            out["grad_per_key"] = jax.vmap(per_key)(rest["keys"])
        return out

    return jax.jit(run)


def _modes(cell):
    options = cell["options"].values()
    if any(isinstance(v, str) and "custom_vjp" in v for v in options):
        return ("value", "grad")  # reverse mode only
    if cell["function"] == "trace_funm" and _x_kind(cell) == "block":
        # Keys split over the devices: also a `vmap` of the gradient for each key,
        # unless `A` is split too (along the axis of the keys: a type that JAX does
        # not have, which `vmap` refuses for any function).
        if cell["A"] == "replicated":
            return ("value", "grad", "jvp", "grad_per_key")
    return ("value", "grad", "jvp")


def _inputs(prob, place, order):
    """The program's arguments: differentiable arrays, the others, tangents."""

    def ordered(name, value):
        return value if order is None or prob.kinds[name] != "entries" else value[order]

    diff, rest, tangent = {}, {}, {}
    for name, value in prob.arrays.items():
        target = diff if name in prob.tangent else rest
        target[name] = place(name, ordered(name, value))
        if name in prob.tangent:
            tangent[name] = place(name, ordered(name, prob.tangent[name]))
    return diff, rest, tangent


# How a cell's results are compared: the reference's operator for each kind (the
# same matrix; only `iterate`'s linear steps differ from its nonlinear ones), and
# the options whose value changes what is computed, not only how.
def _reference_operator(function, operator):
    if function in ("iterate", "spectrum") and operator in ("closure", "module"):
        return "closure"
    return "dense"


def _reference_options(function, options):
    if function == "readout":
        return (("basis", options["basis"]),)
    if function == "funm_action":
        return (("method", options["method"]), ("tol", options["tol"]))
    if function == "block_funm":
        return (("method", options["method"]),)
    if function == "trace_funm":
        tol = (("tol", options["tol"]),) if "tol" in options else ()
        return (("estimator", options["estimator"]), *tol)
    return ()


# The functions whose block `x0` is `B` independent problems (the columns of a
# block, or a `jax.vmap`), and the axis of the value that stacks them.
COLUMNS = dict(
    krylov=2,
    chebyshev=2,
    arnoldi=0,
    lanczos=0,
    funm_action=0,
    trace_funm=0,
    spectrum=0,
    linear_dynamics=0,
)


def _reference_program(function, operator, size, math):
    prob = problem(function, operator, "vector", size)
    options = {k: v[0] for k, v in FUNCTIONS[function]["options"].items()}
    options.update(math)
    return prob, _program(prob, options, ("value", "grad", "jvp"))


@functools.cache
def reference(function, operator, x_kind, size, math) -> dict:
    """Value, gradient and JVP on one device, with the function's first options
    (and `math`). A block of independent problems (`COLUMNS`) is assembled from
    the program for one vector, run on each (one compilation fewer)."""
    one = jax.devices()[0]
    if x_kind != "block" or function not in COLUMNS:
        prob = problem(function, operator, x_kind, size)
        options = {k: v[0] for k, v in FUNCTIONS[function]["options"].items()}
        options.update(math)
        diff, rest, tangent = _inputs(prob, lambda _, v: jax.device_put(v, one), None)
        out = _program(prob, options, ("value", "grad", "jvp"))(diff, rest, tangent)
        return jax.tree.map(np.asarray, out)
    prob, program = _reference_program(function, operator, size, math)
    block = problem(function, operator, "block", size)
    diff, rest, tangent = _inputs(prob, lambda _, v: jax.device_put(v, one), None)
    parts = []
    for j in range(B):
        if function in ("trace_funm", "spectrum"):
            rest = dict(rest, key=block.arrays["keys"][j])
        else:
            diff = dict(diff, x0=block.arrays["x0"][:, j])
            tangent = dict(tangent, x0=block.tangent["x0"][:, j])
        parts.append(jax.tree.map(np.asarray, program(diff, rest, tangent)))
    axis = COLUMNS[function]
    grads = [p["grad"] for p in parts]
    grad = {k: sum(g[k] for g in grads) for k in grads[0] if k != "x0"}
    if "x0" in grads[0]:
        grad["x0"] = np.stack([g["x0"] for g in grads], axis=1)

    def stacked(mode):
        return jax.tree.map(lambda *xs: np.stack(xs, axis), *[p[mode] for p in parts])

    out = dict(value=stacked("value"), grad=grad, jvp=stacked("jvp"))
    if function == "trace_funm":
        out["grad_per_key"] = jax.tree.map(lambda *xs: np.stack(xs), *grads)
    return out


def _expected(cell, prob, size) -> dict:
    """The one-device results a cell must match, in its problem's terms: for a
    BCOO matrix, the gradient of its stored values is the dense gradient at their
    positions."""
    x_kind = "vector" if _x_kind(cell) == "like" else _x_kind(cell)
    kind = _reference_operator(cell["function"], cell["operator"])
    math = _reference_options(cell["function"], cell["options"])
    want = reference(cell["function"], kind, x_kind, size, math)
    if prob.operator == "bcoo":
        rows, cols = prob.arrays["indices"].T
        for mode in ("grad", "grad_per_key"):
            if mode in want:
                grad = dict(want[mode])
                grad["data"] = grad.pop("S")[..., rows, cols]
                want = dict(want, **{mode: grad})
    return want


def _host(out, cell, prob, order) -> dict:
    """A cell's results on the host, in the reference's terms: the stored entries
    back in their first order, `krylov`'s rows layout as columns."""
    out = jax.tree.map(np.asarray, out)
    for mode in ("grad", "grad_per_key"):
        if order is not None and mode in out:
            grad = dict(out[mode])
            data = np.empty_like(grad["data"])
            data[..., order] = grad["data"]
            out[mode] = dict(grad, data=data)
    krylov = cell["function"] in ("krylov", "chebyshev")
    if krylov and cell["options"]["layout"] == "rows":
        for mode in ("value", "jvp"):
            if mode in out:
                out[mode] = np.moveaxis(out[mode], 0, 1)
    return out


def _error(got, want) -> float:
    """The largest difference relative to the largest entry, over the leaves."""
    errors = []
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        scale = max(float(np.max(np.abs(w), initial=0.0)), np.finfo(np.float64).tiny)
        errors.append(float(np.max(np.abs(g - w), initial=0.0)) / scale)
    return max(errors, default=0.0)


def _describe_error(e: Exception) -> dict:
    tb = traceback.extract_tb(e.__traceback__)
    ours = bool(tb) and f"{os.sep}krylovjax{os.sep}" in tb[-1].filename
    message = str(e).splitlines()[0][:300] if str(e) else ""
    return {"type": type(e).__name__, "message": message, "raised_by_krylovjax": ours}


def _spec(x) -> list:
    """An array's PartitionSpec as a list with one entry per axis."""
    spec = tuple(getattr(x.sharding, "spec", ()))
    return [
        None if p is None else str(p) for p in spec + (None,) * (x.ndim - len(spec))
    ]


class _NoMesh:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run_cell(cell: dict) -> dict:
    """Run one cell and return its record (see the module docstring)."""
    size = tuple(cell.get("size") or (N, D))
    prob = problem(cell["function"], cell["operator"], _x_kind(cell), size)
    want = _expected(cell, prob, size)
    axis_type = AxisType.Explicit if cell["mesh"] == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((DEVICES,), ("x",), axis_types=(axis_type,))
    order = _order(cell, prob)
    unplaced = {"x0": ("x0",), "A": ("A", "entries")}.get(cell.get("unplaced"), ())

    def place(name, value):
        kind = prob.kinds[name]
        if kind in unplaced:
            return jnp.asarray(value)
        sharding = NamedSharding(mesh, _spec_of(kind, cell, np.ndim(value)))
        return jax.device_put(value, sharding)

    diff, rest, tangent = _inputs(prob, place, order)
    modes = _modes(cell)
    closed = {}
    if cell.get("closed"):
        # The vectors closed over: not arguments, so without gradient or tangent.
        names = [name for name in diff if prob.kinds[name] == "x0"]
        closed = {name: diff.pop(name) for name in names}
        for name in names:
            tangent.pop(name)
        grad = {k: v for k, v in want["grad"].items() if k not in names}
        want = dict(want, grad=grad)
        modes = tuple(m for m in modes if m != "jvp")
    record = dict(id=cell_id(cell), cell=cell, modes=list(modes), errors={})
    record["failures"] = {}

    def attempt(which):
        with jax.set_mesh(mesh) if cell["context"] == "inside" else _NoMesh():
            program = _program(
                prob, cell["options"], which, closed, cell.get("gathered", False)
            )
            out = program(diff, rest, tangent)
            return jax.block_until_ready(out)

    start = time.perf_counter()
    try:
        results = attempt(modes)
    except Exception:  # name the failing modes, one program each
        results = {}
        for mode in modes:
            try:
                results.update(attempt((mode,)))
            except Exception as e:
                record["failures"][mode] = _describe_error(e)
    record["seconds"] = time.perf_counter() - start
    host = _host(results, cell, prob, order)
    for mode in results:
        record["errors"][mode] = _error(host[mode], want[mode])
    if "grad" in results:
        record["grad_specs"] = {k: _spec(g) for k, g in results["grad"].items()}
        record["input_specs"] = {k: _spec(x) for k, x in diff.items()}
    if "value" in results:
        leaves = jax.tree.leaves(results["value"])
        record["value_specs"] = [_spec(leaf) for leaf in leaves]
        record["value_devices"] = [len(leaf.sharding.device_set) for leaf in leaves]
        inputs = {**diff, **closed}
        record["x0_spec"] = _spec(inputs["x0"]) if "x0" in inputs else None
    return record


# ------------------------------------------------------------------ the verdicts

# Errors a cell may end in: (predicate on the cell, the exception's type, a
# regular expression its message matches). Each is raised by krylovjax and names
# what to change.
DOCUMENTED = (
    # A callable whose own product JAX cannot type for x0's sharding: a matrix
    # split by columns times a vector split by rows, or, under `jax.vmap` over
    # starting vectors split over the mesh, a matrix split by rows.
    (
        lambda c: (
            c["mesh"] == "explicit"
            and (c["operator"] in ("closure", "module") or c["function"] == "iterate")
        ),
        "ValueError",
        r"`\w+\((A|step)=\.\.\.\)` cannot be applied to "
        r"`\w+\((x0|b|like)=\.\.\.\)`",
    ),
)


# Failures of JAX itself, which code outside krylovjax meets the same way:
# (predicate, type, message, the reason). They are reported (and counted by the
# test) but do not fail the grid.
def _bcoo_step_on_explicit(c):
    return (
        c["function"] == "iterate"
        and c["mesh"] == "explicit"
        and c["operator"] == "bcoo"
    )


_JAX_BCOO = (
    "JAX, not krylovjax: the step's own BCOO product `M @ x` does not lower on an "
    "explicit mesh when `M` or `x` is split (its gather and scatter state no output "
    "sharding); `jax.jit(lambda M, x: M @ x)` alone fails the same ways. A BCOO "
    "matrix given to krylovjax as the operator works on every layout"
)
KNOWN = (
    (_bcoo_step_on_explicit, "ShardingTypeError", r"Use `\.at\[\.\.\.\]\.", _JAX_BCOO),
    (
        _bcoo_step_on_explicit,
        "DuplicateSpecError",
        r"A single NamedSharding",
        _JAX_BCOO,
    ),
)


def _matches(table, cell: dict, failure: dict, ours: bool) -> bool:
    return (not ours or failure["raised_by_krylovjax"]) and any(
        predicate(cell)
        and failure["type"] == kind
        and re.match(pattern, failure["message"])
        for predicate, kind, pattern, *_ in table
    )


def _documented(cell: dict, failure: dict) -> bool:
    return _matches(DOCUMENTED, cell, failure, ours=True)


def known(record: dict) -> bool:
    """Whether every failure of a record is one of `KNOWN`."""
    failures = record["failures"].values()
    return bool(failures) and all(
        _matches(KNOWN, record["cell"], f, ours=False) for f in failures
    )


def _krylov_spec(record) -> list | None:
    """The sharding `krylov`'s output must have on an explicit mesh: `x0`'s, with
    the new axis unsplit, where the layout puts it."""
    x0 = record["x0_spec"] or [None]
    layout = record["cell"]["options"]["layout"]
    return [None, *x0] if layout == "rows" else [x0[0], None, *x0[1:]]


# `krylov`'s output shardings on an `Auto` mesh (docs/multi_device.md, "What
# sharding the output gets"), by (A, x0, layout).
AUTO_SPECS = {
    ("rows", "replicated", "columns"): ["x", None],
    ("rows", "replicated", "rows"): [None, "x"],
    ("replicated", "block", "columns"): [None, None, "x"],
    ("replicated", "block", "rows"): [None, None, "x"],
}


def problems(record: dict) -> list[str]:
    """What is wrong with a record: an undocumented failure, a difference from
    one device, or a sharding that breaks a documented guarantee: every output
    spans the mesh; on an `Explicit` mesh every gradient has its array's sharding
    and `krylov`'s output that of `x0` (the bases' as `_decomposition_specs`
    says); on an `Auto` mesh the shardings of `AUTO_SPECS`, with the gradient of
    `A` sharded like `A`."""
    cell, out = record["cell"], []
    if known(record):
        return out
    for mode, failure in record["failures"].items():
        if not _documented(cell, failure):
            out.append(f"{mode}: {failure['type']}: {failure['message']}")
    for mode, error in record["errors"].items():
        if not error < RTOL:
            out.append(f"{mode}: relative difference {error:.3g} from one device")
    if any(n != DEVICES for n in record.get("value_devices", ())):
        out.append(f"value on {record['value_devices']} devices, not {DEVICES}")
    explicit = cell["mesh"] == "explicit"
    for name, spec in record.get("grad_specs", {}).items():
        auto_table = cell.get("auto_table") and name == "S"
        if (explicit or auto_table) and spec != record["input_specs"][name]:
            want = record["input_specs"][name]
            out.append(f"gradient of {name} sharded {spec}, not like it: {want}")
    krylov = cell["function"] in ("krylov", "chebyshev") and "value_specs" in record
    if krylov and explicit and record["value_specs"][0] != _krylov_spec(record):
        want = _krylov_spec(record)
        out.append(f"value sharded {record['value_specs'][0]}, not {want}")
    if krylov and cell.get("auto_table"):
        want = AUTO_SPECS[cell["A"], cell["x0"], cell["options"]["layout"]]
        if record["value_specs"][0] != want:
            out.append(f"value sharded {record['value_specs'][0]}, not {want}")
    decomposition = cell["function"] in ("arnoldi", "lanczos")
    if decomposition and explicit and cell["x0"] != "block" and "value_specs" in record:
        want = _decomposition_specs(record)
        if record["value_specs"] != want:
            out.append(f"outputs sharded {record['value_specs']}, not {want}")
    return out


def _decomposition_specs(record) -> list:
    """On an explicit mesh (docs/multi_device.md): the basis `(n, d)` and the
    residual sharded like `x0`, the small outputs replicated."""
    axis = (record["x0_spec"] or [None])[0]
    specs = [[None] * len(spec) for spec in record["value_specs"]]
    specs[0], specs[-2] = [axis, None], [axis]  # basis, ..., residual, norm
    return specs


# The two halves of the grid, by function, so that two processes can run them at
# once and neither computes the other's references.
SHARDS = (
    (
        "krylov",
        "iterate",
        "linear_dynamics",
        "graph_conv",
        "state_space",
        "trace_funm",
        "block_funm",
        "spectrum",
    ),
    ("arnoldi", "lanczos", "funm_action", "chebyshev", "readout"),
)


def _in_parallel(argv: list[str]) -> int:
    """This script once per shard, the processes at once; its exit status is the
    largest of theirs."""
    runs = [
        subprocess.Popen([sys.executable, __file__, *argv, "--shard", str(i)])
        for i in range(len(SHARDS))
    ]
    return max(run.wait() for run in runs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="the full grid")
    parser.add_argument(
        "--targeted", action="store_true", help="only the TARGETED cells"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the records as one JSON line"
    )
    parser.add_argument("--shard", type=int, help="only the cells of SHARDS[i]")
    parser.add_argument(
        "--parallel", action="store_true", help="each shard in its own process, at once"
    )
    parser.add_argument("--function", help="only this function's cells")
    parser.add_argument("--only", help="only the cells whose id contains this")
    parser.add_argument("--list", action="store_true", help="print the cell ids")
    args = parser.parse_args(argv)
    if args.parallel:
        return _in_parallel(["--all"] if args.all else [])
    cells = list(TARGETED) if args.targeted else grid_cells(args.all)
    if args.shard is not None:
        cells = [c for c in cells if c["function"] in SHARDS[args.shard]]
    if args.function:
        cells = [c for c in cells if c["function"] == args.function]
    if args.only:
        cells = [c for c in cells if args.only in cell_id(c)]
    if args.list:
        print("\n".join(cell_id(c) for c in cells))
        return 0
    # As the test suite (`tests/conftest.py`), and most optimisations off (see
    # the module docstring); not when the tests import this module.
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.config.update("jax_disable_most_optimizations", True)
    if jax.device_count() != DEVICES:
        msg = (
            f"this script needs {DEVICES} devices; set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES} before JAX "
            f"starts; got {jax.device_count()}."
        )
        raise RuntimeError(msg)
    start = time.perf_counter()
    records = []
    for cell in cells:
        record = run_cell(cell)
        record["problems"] = problems(record)
        record["known"] = known(record)
        status = "FAIL" if record["problems"] else "ok"
        status = "known" if record["known"] else status
        if status == "ok" and record["failures"]:
            status = "documented"
        line = f"{status} {record['seconds']:.2f}s {record['id']}"
        print(line, *record["problems"], sep="\n    ", file=sys.stderr)
        records.append(record)
    wall = time.perf_counter() - start
    bad = [r for r in records if r["problems"]]
    n_known = sum(r["known"] for r in records)
    n_documented = sum(bool(r["failures"]) and not r["known"] for r in records)
    summary = (
        f"{len(records)} cells: {len(bad)} failed, {n_known} known failures, "
        f"{n_documented} documented errors; {wall:.1f} s"
    )
    print(summary, file=sys.stderr)
    if args.json:
        # The records, for the test (the last line of the output).
        print(json.dumps(dict(records=records, seconds=wall)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
