"""`krylov` on an operator or starting block sharded over four devices.

The device count is fixed when JAX starts, so the work happens in a subprocess
(`tests/_sharding_script.py`) started with
`XLA_FLAGS=--xla_force_host_platform_device_count=4`. It runs every case once under
`jax.jit` and reports, per case, the relative differences from the single-device
computation and the shardings of the results; the tests below check those records.

Cases: a 1-D mesh with axis "x" of type `Auto` or `Explicit` (what `jax.make_mesh`
creates by default); `A` row-sharded (`P("x", None)`) with a replicated `x0` of shape
`(n,)`, or a replicated `A` with `x0` of shape `(n, b)` sharded along `b`
(`P(None, "x")`); both layouts and both adjoints. Values in float64.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).with_name("_sharding_script.py")
MESHES = ("auto", "explicit")
OPERANDS = ("rows", "batch")
LAYOUTS = ("columns", "rows")
ADJOINTS = ("custom_vjp", "custom_jvp", "autodiff")
RTOL = 1e-12


@pytest.fixture(scope="module")
def records() -> dict[tuple[str, str, str, str], dict]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, str(SCRIPT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    return {
        (r["mesh"], r["operands"], r["layout"], r["adjoint"]): r
        for r in json.loads(lines[-1])
    }


def _cases():
    for mesh in MESHES:
        for operands in OPERANDS:
            for layout in LAYOUTS:
                for adjoint in ADJOINTS:
                    case = (mesh, operands, layout, adjoint)
                    yield pytest.param(*case, id="-".join(case))


@pytest.mark.parametrize("mesh,operands,layout,adjoint", list(_cases()))
def test_sharded_matches_single_device(records, mesh, operands, layout, adjoint):
    record = records[(mesh, operands, layout, adjoint)]
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


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("adjoint", ADJOINTS)
def test_auto_mesh_output_sharding(records, layout, adjoint):
    """On an `Auto` mesh the output keeps the sharded axis of its input."""
    stack = "None, 'x'" if layout == "rows" else "'x', None"
    rows = records[("auto", "rows", layout, adjoint)]
    assert rows["out_sharding"]["spec"] == f"P({stack})", rows
    batch = records[("auto", "batch", layout, adjoint)]
    assert batch["out_sharding"]["spec"] == "P(None, None, 'x')", batch
