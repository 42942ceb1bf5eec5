"""Run `krylov` on four forced host devices and report sharded vs unsharded results.

`tests/test_sharding.py` runs this file in a subprocess, because the number of host
devices (`XLA_FLAGS=--xla_force_host_platform_device_count=4`) is fixed when JAX
starts. It prints one JSON line: a list of records, one per case of `cases()`:

    mesh axis type ("auto", "explicit")
    x operands ("rows": A row-sharded, x0 of shape (n,) replicated;
                "batch": A replicated, x0 of shape (n, b) sharded along b;
                and, for a few kinds, both sharded along the axis that the
                reverse pass's product with A contracts: "rows_both" (x0 of
                shape (n,) sharded too), "block_rows" (x0 of shape (n, b) sharded
                along n), "block_columns" (A column-sharded, x0 of shape (n, b)
                sharded along b))
    x operator ("matrix": A itself; "callable": `lambda v: A @ v`, closing over A)
    x method ("scan", "doubling") x layout ("columns", "rows")
    x adjoint ("custom_vjp", "custom_jvp", "autodiff")

(not every combination: see `cases()`). Each record holds the largest relative
differences between the sharded and the single-device computation (forward,
gradient of A, gradient of x0), the output's sharding and whether the gradient of A
has A's sharding; or the error raised. Everything runs in float64.
"""

import functools
import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import krylovjax  # noqa: E402

N, B, D = 16, 4, 6
MESHES = ("auto", "explicit")
OPERANDS = ("rows", "batch")
LAYOUTS = ("columns", "rows")
ADJOINTS = ("custom_vjp", "custom_jvp", "autodiff")
# (operator, method, layouts, adjoints), run for every mesh and operands at (N, D).
KINDS = (
    ("matrix", "scan", LAYOUTS, ADJOINTS),
    ("callable", "scan", ("columns",), ADJOINTS),
    ("matrix", "doubling", LAYOUTS, ("custom_vjp", "autodiff")),
)
# Only on an explicit mesh, where the reverse pass must say how its product with A
# is sharded: the scan with a matrix (each adjoint) and a callable, and doubling.
SHARED_OPERANDS = ("rows_both", "block_rows", "block_columns")
SHARED_KINDS = (
    ("matrix", "scan", ("columns",), ADJOINTS),
    ("callable", "scan", ("columns",), ("custom_jvp",)),
    ("matrix", "doubling", ("columns",), ("custom_vjp",)),
)
# Problems (operands, n, d) sized so that doubling's own reverse pass meets both of
# its schemes on both kinds of sharded operands: with the default sizes, (rows, 16, 6)
# takes Hillis-Steele and (batch, 16, 6) the transposed levels; these two the others.
DOUBLING_PROBLEMS = (("rows", N, 32), ("batch", 64, 5))


def _grid(mesh: str, operands_kinds: tuple[str, ...], kinds: tuple) -> list[dict]:
    """The cases at (N, D) of every operands kind with every (operator, method,
    layouts, adjoints) of `kinds`."""
    return [
        dict(
            mesh=mesh,
            operands=operands,
            operator=operator,
            method=method,
            layout=layout,
            adjoint=adjoint,
            n=N,
            d=D,
        )
        for operands in operands_kinds
        for operator, method, layouts, adjoints in kinds
        for layout in layouts
        for adjoint in adjoints
    ]


def cases() -> list[dict]:
    """Every case, as the keyword arguments of `_run_case`.

    The scan with a matrix and with a callable, every layout and adjoint; doubling
    with a matrix, every layout and both of its adjoints; on the explicit mesh the
    `SHARED_OPERANDS` too; and doubling's custom reverse pass on the problems of
    `DOUBLING_PROBLEMS`.
    """
    out = []
    for mesh in MESHES:
        out += _grid(mesh, OPERANDS, KINDS)
        if mesh == "explicit":
            out += _grid(mesh, SHARED_OPERANDS, SHARED_KINDS)
        for operands, n, d in DOUBLING_PROBLEMS:
            out.append(
                dict(
                    mesh=mesh,
                    operands=operands,
                    operator="matrix",
                    method="doubling",
                    layout="columns",
                    adjoint="custom_vjp",
                    n=n,
                    d=d,
                )
            )
    return out


def case_id(case: dict) -> str:
    keys = ("mesh", "operands", "operator", "method", "layout", "adjoint")
    return "-".join(case[k] for k in keys) + f"-n{case['n']}-d{case['d']}"


def _problem(operands: str, n: int) -> tuple[jax.Array, jax.Array, P, P]:
    """Return A, x0 and their partition specs over a 1-D mesh axis named "x"."""
    key_a, key_x = jax.random.split(jax.random.key(0))
    # Scaled so that the powers of A stay of order one.
    A = jax.random.normal(key_a, (n, n), dtype=jnp.float64) / jnp.sqrt(n)
    if operands in ("rows", "rows_both"):
        x0 = jax.random.normal(key_x, (n,), dtype=jnp.float64)
        return A, x0, P("x", None), P("x") if operands == "rows_both" else P()
    x0 = jax.random.normal(key_x, (n, B), dtype=jnp.float64)
    if operands == "block_rows":
        return A, x0, P("x", None), P("x", None)
    if operands == "block_columns":
        return A, x0, P(None, "x"), P(None, "x")
    return A, x0, P(), P(None, "x")


def _functions(operator: str, method: str, layout: str, adjoint: str, d: int):
    def forward(A, x0):
        op = A if operator == "matrix" else (lambda v: A @ v)
        return krylovjax.krylov(
            op, x0, d, layout=layout, adjoint=adjoint, method=method
        )

    def loss(A, x0):
        # A nonlinear loss, so that the output cotangent is not a constant.
        return jnp.sum(jnp.sin(forward(A, x0)))

    return jax.jit(forward), jax.jit(jax.grad(loss, argnums=(0, 1)))


def _relative_error(x: jax.Array, ref: jax.Array) -> float:
    # Compared on the host: the two arrays live on different sets of devices.
    x, ref = np.asarray(x), np.asarray(ref)
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def _describe(sharding: jax.sharding.Sharding) -> dict:
    spec = getattr(sharding, "spec", None)
    return {
        "type": type(sharding).__name__,
        "spec": None if spec is None else str(spec),
        "num_devices": len(sharding.device_set),
    }


@functools.cache
def _reference(
    operands: str, operator: str, method: str, layout: str, adjoint: str, n: int, d: int
) -> tuple[np.ndarray, ...]:
    """Values and gradients on a single device, by the same jitted functions."""
    A, x0, _, _ = _problem(operands, n)
    forward, grad = _functions(operator, method, layout, adjoint, d)
    one = jax.devices()[0]
    A, x0 = jax.device_put(A, one), jax.device_put(x0, one)
    return (forward(A, x0), *grad(A, x0))


def _run_case(
    mesh: str,
    operands: str,
    operator: str,
    method: str,
    layout: str,
    adjoint: str,
    n: int,
    d: int,
) -> dict:
    axis_type = AxisType.Explicit if mesh == "explicit" else AxisType.Auto
    device_mesh = jax.make_mesh((4,), ("x",), axis_types=(axis_type,))
    A, x0, spec_A, spec_x0 = _problem(operands, n)
    forward, grad = _functions(operator, method, layout, adjoint, d)

    ref_out, ref_gA, ref_gx = _reference(
        operands, operator, method, layout, adjoint, n, d
    )

    sharding_A = NamedSharding(device_mesh, spec_A)
    As = jax.device_put(A, sharding_A)
    x0s = jax.device_put(x0, NamedSharding(device_mesh, spec_x0))
    record = dict(mesh=mesh, operands=operands, operator=operator, method=method)
    record.update(layout=layout, adjoint=adjoint, n=n, d=d, error=None)
    try:
        out = forward(As, x0s)
        gA, gx = grad(As, x0s)
    except Exception as e:  # reported to the test, which fails with the message
        record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        return record
    record["out_error"] = _relative_error(out, ref_out)
    record["grad_A_error"] = _relative_error(gA, ref_gA)
    record["grad_x0_error"] = _relative_error(gx, ref_gx)
    record["out_sharding"] = _describe(out.sharding)
    record["grad_A_sharding"] = _describe(gA.sharding)
    record["grad_x0_sharding"] = _describe(gx.sharding)
    record["grad_A_has_A_sharding"] = bool(
        gA.sharding.is_equivalent_to(sharding_A, gA.ndim)
    )
    return record


def main() -> list[dict]:
    if jax.device_count() != 4:
        msg = (
            "this script needs 4 devices; set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=4 before JAX starts; "
            f"got {jax.device_count()}."
        )
        raise RuntimeError(msg)
    return [dict(_run_case(**case), id=case_id(case)) for case in cases()]


if __name__ == "__main__":
    print(json.dumps(main()))
