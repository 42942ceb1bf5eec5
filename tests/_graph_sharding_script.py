"""A graph row-partitioned over four forced host devices, against one device.

`tests/test_sparse.py` runs this file in a subprocess (the device count is fixed
when JAX starts). The node features `x0` of shape `(n, b)` are sharded on their
first axis, and so are the stored entries of the BCOO adjacency (sorted by rows, so
each device holds the entries of its own block of rows), on an `Auto` and on an
`Explicit` mesh, with the default derivative rule and with plain autodiff; and
arrays never placed on a mesh are used inside `jax.set_mesh`. It prints one JSON
line: for each case, the largest relative differences of the forward pass and of
the gradients of the edge weights and of `x0` against one device, and for the
sharded cases the number of devices the output spans.
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
    records = {}
    for adjoint in (None, "autodiff"):

        def forward(data, indices, x0, adjoint=adjoint):
            A = sparse.BCOO((data, indices), shape=(N, N), indices_sorted=True)
            return krylovjax.krylov(A, x0, D, adjoint=adjoint)

        def loss(data, indices, x0, forward=forward):
            return jnp.sum(jnp.sin(forward(data, indices, x0)))

        grad = jax.grad(loss, (0, 2))
        want = (
            jax.jit(forward)(data, indices, x0),
            *jax.jit(grad)(data, indices, x0),
        )
        for kind in (AxisType.Auto, AxisType.Explicit):
            mesh = jax.make_mesh((4,), ("x",), axis_types=(kind,))
            with jax.set_mesh(mesh):
                args = (
                    jax.device_put(data, NamedSharding(mesh, P("x"))),
                    jax.device_put(indices, NamedSharding(mesh, P("x", None))),
                    jax.device_put(x0, NamedSharding(mesh, P("x", None))),
                )
                got = (jax.jit(forward)(*args), *jax.jit(grad)(*args))
            errors = [
                float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w)))
                for g, w in zip(got, want, strict=True)
            ]
            records[f"{kind.name}-{adjoint}"] = {
                "errors": errors,
                "devices": len(got[0].sharding.device_set),
            }
        # Arrays never placed on the mesh, used inside `jax.set_mesh`: they run
        # as they would without it.
        with jax.set_mesh(jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))):
            got = (
                jax.jit(forward)(data, indices, x0),
                *jax.jit(grad)(data, indices, x0),
            )
        errors = [
            float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w)))
            for g, w in zip(got, want, strict=True)
        ]
        records[f"unplaced-{adjoint}"] = {"errors": errors}
    print(json.dumps(records))


if __name__ == "__main__":
    main()
