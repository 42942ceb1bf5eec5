"""`krylov` on an operator or starting block sharded over four devices.

The device count is fixed when JAX starts, so the work happens in a subprocess
(`tests/_sharding_script.py`) started with
`XLA_FLAGS=--xla_force_host_platform_device_count=4`. It runs every case once under
`jax.jit` and reports, per case, the relative differences from the single-device
computation and the shardings of the results; the tests below check those records.

Cases: a 1-D mesh with axis "x" of type `Auto` or `Explicit` (what `jax.make_mesh`
creates by default); `A` row-sharded (`P("x", None)`) with a replicated `x0` of shape
`(n,)`, or a replicated `A` with `x0` of shape `(n, b)` sharded along `b`
(`P(None, "x")`); `A` passed as the matrix or as a closure `lambda v: A @ v`; the
scan with every adjoint and doubling with both of its adjoints, both layouts; and
doubling's reverse pass on sizes that meet both of its schemes (transposed levels,
Hillis-Steele scan) for both kinds of sharded operands. And operands sharded along
the axis that the reverse pass's product with `A` contracts, where on an explicit
mesh it must state how its output is sharded: `A` and a vector `x0` both sharded by
rows, `A` by rows with a block `x0` sharded along `n`, and `A` by columns with a
block sharded along `b` (on an `Auto` mesh XLA shards the products itself). Values
in float64.
"""

import pytest
from helpers import run_on_four_devices

SCRIPT = "_sharding_script.py"
MESHES = ("auto", "explicit")
OPERANDS = ("rows", "batch")
LAYOUTS = ("columns", "rows")
ADJOINTS = ("custom_vjp", "custom_jvp", "autodiff")
N, D = 16, 6
# (operator, method, layouts, adjoints), run for every mesh and operands at (N, D).
KINDS = (
    ("matrix", "scan", LAYOUTS, ADJOINTS),
    ("callable", "scan", ("columns",), ADJOINTS),
    ("matrix", "doubling", LAYOUTS, ("custom_vjp", "autodiff")),
)
# Doubling's own reverse pass transposes its levels when the powers of A fit in
# memory and runs a Hillis-Steele scan otherwise; (operands, n, d) sizes on which
# each kind of sharded operand meets both (the last two run with layout "columns"
# only, on top of the (N, D) cases of KINDS).
DOUBLING_PROBLEMS = (("rows", N, 32), ("batch", 64, 5))
# Operands sharded on the axis the reverse product contracts, and what runs on them,
# on the explicit mesh.
SHARED_OPERANDS = ("rows_both", "block_rows", "block_columns")
SHARED_KINDS = (
    ("matrix", "scan", ("columns",), ADJOINTS),
    ("callable", "scan", ("columns",), ("custom_jvp",)),
    ("matrix", "doubling", ("columns",), ("custom_vjp",)),
)
RTOL = 1e-12


def _id(mesh, operands, operator, method, layout, adjoint, n=N, d=D) -> str:
    # As `case_id` in the script.
    return f"{mesh}-{operands}-{operator}-{method}-{layout}-{adjoint}-n{n}-d{d}"


def _grid(mesh, operands_kinds, kinds) -> list[str]:
    return [
        _id(mesh, operands, operator, method, layout, adjoint)
        for operands in operands_kinds
        for operator, method, layouts, adjoints in kinds
        for layout in layouts
        for adjoint in adjoints
    ]


def _case_ids() -> list[str]:
    # The cases of the script's `cases()`, written out again from the constants
    # above, so that a case the script drops fails `test_every_case_ran`.
    ids = []
    for mesh in MESHES:
        ids += _grid(mesh, OPERANDS, KINDS)
        if mesh == "explicit":
            ids += _grid(mesh, SHARED_OPERANDS, SHARED_KINDS)
        for operands, n, d in DOUBLING_PROBLEMS:
            ids.append(
                _id(mesh, operands, "matrix", "doubling", "columns", "custom_vjp", n, d)
            )
    return ids


@pytest.fixture(scope="module")
def records() -> dict[str, dict]:
    return {r["id"]: r for r in run_on_four_devices(SCRIPT)}


def test_every_case_ran(records):
    assert sorted(records) == sorted(_case_ids())


@pytest.mark.parametrize("case", _case_ids())
def test_sharded_matches_single_device(records, case):
    record = records[case]
    assert record["error"] is None, record["error"]
    # Values and gradients (of A and x0) agree with one device.
    assert record["out_error"] < RTOL, record
    assert record["grad_A_error"] < RTOL, record
    assert record["grad_x0_error"] < RTOL, record
    # The output stays distributed over the mesh instead of being gathered to one
    # device, and the gradient of A has the sharding of A.
    assert record["out_sharding"]["type"] == "NamedSharding", record
    assert record["out_sharding"]["num_devices"] == 4, record
    assert record["grad_A_sharding"]["num_devices"] == 4, record
    assert record["grad_A_has_A_sharding"], record


def _auto_cases():
    for operator, method, layouts, adjoints in KINDS:
        for layout in layouts:
            for adjoint in adjoints:
                case = (operator, method, layout, adjoint)
                yield pytest.param(*case, id="-".join(case))


@pytest.mark.parametrize("operator,method,layout,adjoint", list(_auto_cases()))
def test_auto_mesh_output_sharding(records, operator, method, layout, adjoint):
    """On an `Auto` mesh the output keeps the sharded axis of its input."""
    stack = "None, 'x'" if layout == "rows" else "'x', None"
    rows = records[_id("auto", "rows", operator, method, layout, adjoint)]
    assert rows["out_sharding"]["spec"] == f"P({stack})", rows
    batch = records[_id("auto", "batch", operator, method, layout, adjoint)]
    assert batch["out_sharding"]["spec"] == "P(None, None, 'x')", batch
