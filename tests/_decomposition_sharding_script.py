"""Orthogonal decompositions with a row-sharded matrix on four forced host devices.

`tests/test_funm.py` runs this file in a subprocess (the device count is fixed when
JAX starts). On an `Auto` and on an `Explicit` mesh, `arnoldi`, `lanczos`,
`funm_action` and `trace_funm` (values, and gradients in reverse and forward mode)
with `A` sharded by rows and `x0` sharded or replicated must match one device. It
prints one JSON line: the largest relative differences per mesh kind and `x0`
layout, and how the basis came back sharded.
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

    def funm(A, x0):
        return krylovjax.funm_action(jnp.exp, A, x0, D, method="lanczos")

    def basis_loss(A, x0):
        return jnp.sum(jnp.sin(krylovjax.arnoldi(A, x0, D).basis))

    def outputs(A, x0):
        key = jax.random.key(0)
        return (
            krylovjax.arnoldi(A, x0, D).basis,
            krylovjax.lanczos(A, x0, D).basis,
            funm(A, x0),
            jax.grad(lambda A, x0: jnp.sum(funm(A, x0)), (0, 1))(A, x0),
            jax.grad(basis_loss, (0, 1))(A, x0),
            jax.jvp(lambda A: funm(A, x0), (A,), (jnp.sin(A),))[1],
            krylovjax.trace_funm(jnp.exp, A, key, D, num_probes=3),
        )

    want = jax.jit(outputs)(A, x0)
    record = {}
    for kind in (AxisType.Auto, AxisType.Explicit):
        mesh = jax.make_mesh((4,), ("x",), axis_types=(kind,))
        for layout, spec in (("sharded", P("x")), ("replicated", P())):
            with jax.set_mesh(mesh):
                args = (
                    jax.device_put(A, NamedSharding(mesh, P("x", None))),
                    jax.device_put(x0, NamedSharding(mesh, spec)),
                )
                got = jax.jit(outputs)(*args)
            # The basis comes back sharded by rows like x0 (or replicated).
            spec = tuple(got[0].sharding.spec)
            record[f"{kind.name}, x0 {layout}, basis"] = list(
                spec + (None,) * (2 - len(spec))
            )
            record[f"{kind.name}, x0 {layout}"] = [
                float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w)))
                for g, w in zip(
                    jax.tree.leaves(got), jax.tree.leaves(want), strict=True
                )
            ]
    # Arrays on an explicit mesh, called outside `jax.set_mesh`.
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,))
    args = (
        jax.device_put(A, NamedSharding(mesh, P("x", None))),
        jax.device_put(x0, NamedSharding(mesh, P("x"))),
    )
    got = jax.jit(outputs)(*args)
    record["Explicit, outside set_mesh"] = [
        float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w)))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    ]
    print(json.dumps(record))


if __name__ == "__main__":
    main()
