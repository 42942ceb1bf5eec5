"""Halo-exchange products on a graph partitioned over several processes.

Run by `tests/test_partition.py` as `PROCESSES` processes with `DEVICES` CPU devices
each, on localhost (`jax.distributed.initialize` with a local coordinator, CPU
collectives through gloo):

    python tests/_partition_checks.py PROCESS_ID NUM_PROCESSES PORT OUT.npz

or, for one process with several host devices (then PROCESS_ID is 0 and
NUM_PROCESSES 1, no coordinator is started). Every process computes the same
partition of `problem()` and places only its own devices' blocks; process 0 writes
the results, gathered to the host, to `OUT.npz`, which the test compares with one
device. The same script is the launch recipe of the multi-device page: one command
per host, with the coordinator's address.
"""

import math
import os
import sys

DEVICES = 2  # CPU devices per process

if __name__ == "__main__":
    flags = f"--xla_force_host_platform_device_count={DEVICES}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import sparse  # noqa: E402

D = 5  # Krylov depth
POWERS = 3  # products per exchange of the matrix powers kernel (`steps=`)
HOPS = 3  # KrylovGraphConv's hops
STEPS = 2  # optax steps
LEARNING_RATE = 1e-2


def problem():
    """A weighted, symmetric 2-D grid graph (9 x 9 nodes, two missing: n = 79 is
    not a multiple of 4, so the last block is padded), node features and a
    starting vector, in float64."""
    side = 9
    idx = np.arange(side * side).reshape(side, side)
    r = np.r_[idx[:, :-1].ravel(), idx[:-1].ravel()]
    c = np.r_[idx[:, 1:].ravel(), idx[1:].ravel()]
    n = side * side - 2
    keep = (r < n) & (c < n)
    r, c = r[keep], c[keep]
    rng = np.random.default_rng(0)
    w = rng.uniform(0.05, 0.2, r.size)
    rows, cols, vals = np.r_[r, c], np.r_[c, r], np.r_[w, w]
    A = sparse.BCOO(
        (jnp.asarray(vals), jnp.asarray(np.stack([rows, cols], 1))), shape=(n, n)
    )
    H = rng.standard_normal((n, 3))
    x0 = rng.standard_normal(n)
    return A, H, x0


def computations(A, part=None, mesh=None):
    """The checked computations on `A` (a BCOO matrix, or with `part` and `mesh` the
    partitioned operator); vectors in the partitioned numbering where `part` is
    given. Returns a dict of arrays in the input numbering."""
    import equinox as eqx
    import optax

    import krylovjax

    _, H, x0 = problem()
    values = A.data
    if part is None:
        to, back, unpad = jnp.asarray, gather, (lambda y: y)
        op = None
        make = lambda op, v: sparse.BCOO((v, A.indices), shape=A.shape)  # noqa: E731
    else:
        from jax.sharding import NamedSharding, PartitionSpec as P

        rows = NamedSharding(mesh, P("x"))
        replicated = NamedSharding(mesh, P())

        def to(x):
            x = np.asarray(part.to_partitioned(np.asarray(x)))
            return jax.make_array_from_callback(x.shape, rows, lambda i: x[i])

        def back(y):
            return np.asarray(part.from_partitioned(gather(y)))

        # The padded rows of a layer's output hold its bias: not part of the loss.
        unpad = part.from_partitioned

        v = np.asarray(values)
        values = jax.make_array_from_callback(v.shape, replicated, lambda i: v[i])
        op = part.operator(mesh)

        def make(op, v):
            return op.with_values(part.to_partitioned_values(v))

    out = {}
    x = to(x0)

    def loss(op, v, x):
        X = krylovjax.krylov(make(op, v), x, D)
        return jnp.sum(jnp.sin(X)), X

    grad = jax.grad(loss, (1, 2), has_aux=True)
    (g_values, g_x), X = jax.jit(grad)(op, values, x)
    out["krylov"] = back(X)
    out["krylov_grad_values"] = gather(g_values)
    out["krylov_grad_x0"] = back(g_x)

    def jvp(op, v, x):
        return jax.jvp(
            lambda v, x: krylovjax.krylov(make(op, v), x, D), (v, x), (v, x)
        )[1]

    out["krylov_jvp"] = back(jax.jit(jvp)(op, values, x))

    # Blocks of POWERS products per exchange (d - 1 = 4: one block and one
    # product), with JAX's derivatives: the same values and gradients.
    deep = None if part is None else part.operator(mesh, steps=POWERS)
    (g_values, g_x), X = jax.jit(grad)(deep, values, x)
    out["powers"] = back(X)
    out["powers_grad_values"] = gather(g_values)
    out["powers_grad_x0"] = back(g_x)

    lz = jax.jit(lambda op, v, x: krylovjax.lanczos(make(op, v), x, D))(op, values, x)
    out["lanczos_basis"] = back(lz.basis)
    out["lanczos_diagonal"] = gather(lz.diagonal)
    out["lanczos_off_diagonal"] = gather(lz.off_diagonal)

    def funm_loss(op, v, x):
        y = krylovjax.funm_action(jnp.exp, make(op, v), x, D, method="lanczos")
        return jnp.sum(y**2), y

    (fg_values, fg_x), y = jax.jit(jax.grad(funm_loss, (1, 2), has_aux=True))(
        op, values, x
    )
    out["funm"] = back(y)
    out["funm_grad_values"] = gather(fg_values)
    out["funm_grad_x0"] = back(fg_x)

    # A KrylovGraphConv training step with optax.
    conv = krylovjax.nn.KrylovGraphConv(
        3, 2, HOPS, key=jax.random.key(1), dtype=jnp.float64
    )
    h = to(H)
    optimiser = optax.adam(LEARNING_RATE)
    state = optimiser.init(eqx.filter(conv, eqx.is_array))

    @jax.jit
    def step(conv, state, op, v, h):
        def loss(conv, v):
            return jnp.sum(jnp.tanh(unpad(conv(make(op, v), h))) ** 2)

        value, (g_conv, g_v) = jax.value_and_grad(loss, (0, 1))(conv, v)
        with jax.numpy_dtype_promotion("standard"):  # optax's own arithmetic
            updates, state = optimiser.update(g_conv, state)
        return eqx.apply_updates(conv, updates), state, value, g_v

    for _ in range(STEPS):
        conv, state, value, g_v = step(conv, state, op, values, h)
    out["conv_loss"] = gather(value)
    out["conv_grad_values"] = gather(g_v)
    out["conv_weight"] = gather(conv.weight)
    return out


def permuted_bytes(fn, *args) -> tuple[int, int]:
    """`(bytes, others)`: the bytes that the compiled `fn(*args)` sends by
    collective-permutes, summed over the devices (each instruction's per-device
    result times its source-target pairs, once however often a loop runs it),
    and the number of other collectives."""
    import re

    text = jax.jit(fn).lower(*args).compile().as_text()
    total = others = 0
    sizes = {"f64": 8, "f32": 4, "s32": 4}
    for line in text.splitlines():
        match = re.search(
            r"= (\w+)\[([\d,]*)\][^ ]* collective-permute(?:-start)?\(", line
        )
        if match:
            dtype, dims = match.groups()
            count = math.prod(int(d) for d in dims.split(",") if d)
            pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line).group(1)
            pairs = pairs.count("{")
            total += sizes[dtype] * count * pairs
        elif re.search(
            r" (all-gather|all-reduce|reduce-scatter|all-to-all)(-start)?\(", line
        ):
            others += 1
    return total, others


def gather(y):
    """A global array's value on the host (of every process)."""
    from jax.experimental import multihost_utils

    if y.is_fully_addressable:
        return np.asarray(y)
    if y.is_fully_replicated:
        return np.asarray(y.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(y, tiled=True))


def main(process_id: int, num_processes: int, port: int, out_path: str) -> None:
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_disable_most_optimizations", True)  # as the test suite
    if num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            f"localhost:{port}", num_processes=num_processes, process_id=process_id
        )
    import krylovjax

    A, _, _ = problem()
    parts = jax.device_count()
    mesh = jax.make_mesh((parts,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    part = krylovjax.partition_graph(A, parts)
    out = computations(A, part, mesh)
    out["halo"] = part.halo
    block = np.asarray(part.to_partitioned(problem()[1]))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    block = jax.make_array_from_callback(block.shape, rows, lambda i: block[i])
    out["permuted_bytes"], out["other_collectives"] = permuted_bytes(
        lambda op, x: op(x), part.operator(mesh), block
    )
    out["expected_bytes"] = part.bytes_per_product(block.shape[1], block.dtype)
    # `krylov` with one block of POWERS products, and with one more product: a
    # block after the loop, with an exchange of its own (the values move once per
    # call, and the loop's exchange is one instruction, however often it runs).
    deep = part.operator(mesh, steps=POWERS)

    def powers_bytes(d):
        fn = lambda op, x: krylovjax.krylov(op, x, d)  # noqa: E731
        return permuted_bytes(fn, deep, block)[0]

    one, two = powers_bytes(1 + POWERS), powers_bytes(2 + POWERS)
    out["powers_bytes"] = two - one
    out["expected_powers_bytes"] = part.bytes_per_exchange(
        block.shape[1], block.dtype, POWERS
    )
    if process_id == 0:
        np.savez(out_path, **out)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
