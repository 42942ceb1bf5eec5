"""Multi-device: shard the operator (or the starting block) with `NamedSharding`.

`krylov` needs no special support for several devices: under `jax.jit`, JAX's SPMD
partitioner splits the matrix products of the forward scan and of the hand-written
adjoint according to the shardings of the inputs. This script

1. shards the rows of `A` over a 1-D mesh with a replicated `x0`, and
2. shards a block `x0` of shape `(n, b)` along its batch axis with a replicated `A`,

and in both cases checks that the values and the gradients with respect to `A` and
`x0` match the single-device computation, and prints the shardings of the results.

Run with `python examples/multi_device.py`; it takes a few seconds. On a machine with
one CPU it asks XLA for 4 host devices (`XLA_FLAGS`, set before JAX starts); if JAX
was already started with fewer devices, it uses the devices there are.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import krylovjax  # noqa: E402


def main() -> dict[str, jax.Array]:
    num_devices = min(4, jax.device_count())
    # A 1-D mesh with one axis named "x". `AxisType.Auto` lets the compiler
    # choose the shardings of intermediate values from those of the inputs.
    mesh = jax.make_mesh((num_devices,), ("x",), axis_types=(AxisType.Auto,))
    n, b, d = 8 * num_devices, 2 * num_devices, 6

    key_a, key_x, key_b = jax.random.split(jax.random.key(0), 3)
    A = jax.random.normal(key_a, (n, n)) / jnp.sqrt(n)
    x0 = jax.random.normal(key_x, (n,))
    X0 = jax.random.normal(key_b, (n, b))

    @jax.jit
    def krylov(A, x0):
        return krylovjax.krylov(A, x0, d)

    @jax.jit
    @jax.grad
    def grads(args):
        A, x0 = args
        return jnp.sum(jnp.sin(krylovjax.krylov(A, x0, d)))

    results = {}
    cases = {
        "A row-sharded, x0 replicated": (A, x0, P("x", None), P()),
        "A replicated, block x0 sharded along b": (A, X0, P(), P(None, "x")),
    }
    for name, (A_, x0_, spec_A, spec_x0) in cases.items():
        A_sharded = jax.device_put(A_, NamedSharding(mesh, spec_A))
        x0_sharded = jax.device_put(x0_, NamedSharding(mesh, spec_x0))

        X = krylov(A_sharded, x0_sharded)
        grad_A, grad_x0 = grads((A_sharded, x0_sharded))
        print(f"{name}:")
        devices = len(X.sharding.device_set)
        print(f"  output {X.shape}: {X.sharding.spec} on {devices} devices")
        print(f"  grad A:  {grad_A.sharding.spec}")
        print(f"  grad x0: {grad_x0.sharding.spec}")

        # The same jitted functions on one device give the same numbers.
        one = jax.devices()[0]
        A1, x01 = jax.device_put(A_, one), jax.device_put(x0_, one)
        expected = [krylov(A1, x01), *grads((A1, x01))]
        errors = [
            np.max(np.abs(np.asarray(got) - np.asarray(want)))
            / np.max(np.abs(np.asarray(want)))
            for got, want in zip([X, grad_A, grad_x0], expected, strict=True)
        ]
        print(f"  largest relative difference from one device: {max(errors):.1e}")
        assert max(errors) < 1e-5, errors
        results[name] = X
    return results


if __name__ == "__main__":
    main()
