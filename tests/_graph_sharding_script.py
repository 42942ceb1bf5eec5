"""A graph row-partitioned over four forced host devices, against one device.

`tests/test_sparse.py` runs this file in a subprocess (the device count is fixed
when JAX starts). The node features `x0` of shape `(n, b)` are sharded on their
first axis over an `Auto` mesh; the BCOO adjacency is replicated. It prints one JSON
line: the largest relative differences of the forward pass and of the gradients of
the edge weights and of `x0` between the sharded and the single-device runs, and the
output's sharding.
"""

import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import sparse  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import krylovjax  # noqa: E402

N, B, D = 64, 8, 5


def main() -> None:
    rng = np.random.default_rng(0)
    rows = np.repeat(np.arange(N), 4)
    indices = jnp.asarray(np.stack([rows, rng.integers(0, N, rows.size)], 1))
    data = jnp.asarray(rng.standard_normal(rows.size) / 2)
    x0 = jnp.asarray(rng.standard_normal((N, B)))

    def forward(data, x0):
        A = sparse.BCOO((data, indices), shape=(N, N))
        return krylovjax.krylov(A, x0, D)

    def loss(data, x0):
        return jnp.sum(jnp.sin(forward(data, x0)))

    grad = jax.grad(loss, (0, 1))
    want = (jax.jit(forward)(data, x0), *jax.jit(grad)(data, x0))
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh):
        x0_sharded = jax.device_put(x0, NamedSharding(mesh, P("x", None)))
        got = (
            jax.jit(forward)(data, x0_sharded),
            *jax.jit(grad)(data, x0_sharded),
        )
    errors = [
        float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w)))
        for g, w in zip(got, want, strict=True)
    ]
    record = {"errors": errors, "devices": len(got[0].sharding.device_set)}
    print(json.dumps(record))


if __name__ == "__main__":
    main()
