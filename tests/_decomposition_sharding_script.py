"""Orthogonal decompositions with a row-sharded matrix on four forced host devices.

`tests/test_funm.py` runs this file in a subprocess (the device count is fixed when
JAX starts). On an `Auto` mesh, `arnoldi`, `lanczos` and `funm_action` (value and
gradient) with `A` sharded by rows and `x0` sharded must match one device; on an
`Explicit` mesh they raise a `ValueError` that names the argument. It prints one
JSON line: the largest relative differences, and the error messages.
"""

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

N, D = 16, 6


def main() -> None:
    rng = np.random.default_rng(0)
    G = rng.standard_normal((N, N))
    A = jnp.asarray((G + G.T) / (4 * np.sqrt(N)))
    x0 = jnp.asarray(rng.standard_normal(N))

    def outputs(A, x0):
        f = krylovjax.funm_action(jnp.exp, A, x0, D, method="lanczos")
        grad = jax.grad(
            lambda A: jnp.sum(
                krylovjax.funm_action(jnp.exp, A, x0, D, method="lanczos")
            )
        )(A)
        return (
            krylovjax.arnoldi(A, x0, D).basis,
            krylovjax.lanczos(A, x0, D).basis,
            f,
            grad,
        )

    want = jax.jit(outputs)(A, x0)
    record = {}
    for kind in (AxisType.Auto, AxisType.Explicit):
        mesh = jax.make_mesh((4,), ("x",), axis_types=(kind,))
        with jax.set_mesh(mesh):
            args = (
                jax.device_put(A, NamedSharding(mesh, P("x", None))),
                jax.device_put(x0, NamedSharding(mesh, P("x"))),
            )
            try:
                got = jax.jit(outputs)(*args)
            except ValueError as error:
                record[kind.name] = {"error": str(error)}
                continue
        record[kind.name] = {
            "errors": [
                float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w)))
                for g, w in zip(got, want, strict=True)
            ]
        }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
