"""Run `krylov` on four forced host devices and report sharded vs unsharded results.

`tests/test_sharding.py` runs this file in a subprocess, because the number of host
devices (`XLA_FLAGS=--xla_force_host_platform_device_count=4`) is fixed when JAX
starts. It prints one JSON line: a list of records, one per

    mesh axis type ("auto", "explicit")
    x operands ("rows": A row-sharded, x0 of shape (n,) replicated;
                "batch": A replicated, x0 of shape (n, b) sharded along b)
    x layout ("columns", "rows") x adjoint ("custom_vjp", "custom_jvp", "autodiff").

Each record holds the largest relative differences between the sharded and the
single-device computation (forward, gradient of A, gradient of x0), the output's
sharding, and whether the gradient of A has A's sharding; or the error raised.
Everything runs in float64.
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


def _problem(operands: str) -> tuple[jax.Array, jax.Array, P, P]:
    """Return A, x0 and their partition specs over a 1-D mesh axis named "x"."""
    key_a, key_x = jax.random.split(jax.random.key(0))
    # Scaled so that the powers of A stay of order one.
    A = jax.random.normal(key_a, (N, N), dtype=jnp.float64) / jnp.sqrt(N)
    if operands == "rows":
        x0 = jax.random.normal(key_x, (N,), dtype=jnp.float64)
        return A, x0, P("x", None), P()
    x0 = jax.random.normal(key_x, (N, B), dtype=jnp.float64)
    return A, x0, P(), P(None, "x")


def _functions(layout: str, adjoint: str):
    def forward(A, x0):
        return krylovjax.krylov(A, x0, D, layout=layout, adjoint=adjoint)

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
def _reference(operands: str, layout: str, adjoint: str) -> tuple[np.ndarray, ...]:
    """Values and gradients on a single device, by the same jitted functions."""
    A, x0, _, _ = _problem(operands)
    forward, grad = _functions(layout, adjoint)
    one = jax.devices()[0]
    A, x0 = jax.device_put(A, one), jax.device_put(x0, one)
    return (forward(A, x0), *grad(A, x0))


def _run_case(mesh_kind: str, operands: str, layout: str, adjoint: str) -> dict:
    axis_type = AxisType.Explicit if mesh_kind == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((4,), ("x",), axis_types=(axis_type,))
    A, x0, spec_A, spec_x0 = _problem(operands)
    forward, grad = _functions(layout, adjoint)

    ref_out, ref_gA, ref_gx = _reference(operands, layout, adjoint)

    sharding_A = NamedSharding(mesh, spec_A)
    As = jax.device_put(A, sharding_A)
    x0s = jax.device_put(x0, NamedSharding(mesh, spec_x0))
    record = {"mesh": mesh_kind, "operands": operands}
    record.update(layout=layout, adjoint=adjoint, error=None)
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
    return [
        _run_case(mesh_kind, operands, layout, adjoint)
        for mesh_kind in MESHES
        for operands in OPERANDS
        for layout in LAYOUTS
        for adjoint in ADJOINTS
    ]


if __name__ == "__main__":
    print(json.dumps(main()))
