"""`partition_graph` and `PartitionedOperator`: rows split over devices and
processes, halo exchange, the same values and derivatives as one device."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import _partition_checks as checks  # noqa: E402  (tests/ is on sys.path)
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse

import krylovjax

HERE = Path(__file__).parent
TIMEOUT = 240  # seconds for the processes of one launch


def _path_graph(n):
    rows = np.r_[np.arange(1, n), np.arange(n - 1)]
    cols = np.r_[np.arange(n - 1), np.arange(1, n)]
    values = np.linspace(0.1, 0.3, rows.size)
    return sparse.BCOO(
        (jnp.asarray(values), jnp.asarray(np.stack([rows, cols], 1))), shape=(n, n)
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_device(tmp_path):
    """2 processes x 2 CPU devices (gloo): `krylov` and its derivatives, `lanczos`,
    `funm_action` and its gradient, and two optax steps of a `KrylovGraphConv`
    equal one device in float64; the product moves exactly the halo rows."""
    out = tmp_path / "out.npz"
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(HERE), JAX_PLATFORMS="cpu")
    script = str(HERE / "_partition_checks.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(i), "2", str(port), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    try:
        A, _, _ = checks.problem()
        want = checks.computations(A)  # one device, while the processes run
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT)[0])
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    got = dict(np.load(out))
    assert set(want) <= set(got)
    for name, value in want.items():
        np.testing.assert_allclose(
            got[name], value, rtol=1e-10, atol=1e-12, err_msg=name
        )
    # Rows move between the blocks, and the compiled product sends exactly the
    # padded halo buffers, by collective-permutes only.
    assert got["halo"].sum() > 0
    assert got["permuted_bytes"] == got["expected_bytes"] > 0
    assert got["other_collectives"] == 0
    # With `steps = s`, s more products of `krylov` cost one exchange of the halo
    # s hops deep, and deeper halos move more rows per exchange but fewer per
    # product.
    assert got["powers_bytes"] == got["expected_powers_bytes"] > got["expected_bytes"]
    assert got["expected_powers_bytes"] < checks.POWERS * got["expected_bytes"]


def test_halo_of_a_path_graph():
    part = krylovjax.partition_graph(_path_graph(8), 2, order=None)
    assert part.halo.tolist() == [[0, 1], [1, 0]]
    assert part.shifts == (1,)
    assert part.bytes_per_product(width=64, dtype=np.float32) == 2 * 64 * 4
    assert "num_parts=2" in repr(part)
    # Halos s hops deep: s rows each way across the cut, for s products.
    for steps in (1, 2, 3):
        assert part.bytes_per_exchange(64, np.float32, steps) == steps * 2 * 64 * 4


def test_locality_preserving_order_shrinks_the_halo():
    """A grid numbered at random has halos to every block; reverse Cuthill-McKee
    recovers a banded order with halos to the two neighbouring blocks only."""
    side = 16
    idx = np.arange(side * side).reshape(side, side)
    r = np.r_[idx[:, :-1].ravel(), idx[:-1].ravel()]
    c = np.r_[idx[:, 1:].ravel(), idx[1:].ravel()]
    scramble = np.random.default_rng(0).permutation(side * side)
    rows, cols = scramble[np.r_[r, c]], scramble[np.r_[c, r]]
    A = sparse.BCOO(
        (jnp.ones(rows.size), jnp.asarray(np.stack([rows, cols], 1))),
        shape=(side * side,) * 2,
    )
    given = krylovjax.partition_graph(A, 4, order=None)
    rcm = krylovjax.partition_graph(A, 4)
    assert given.shifts == (1, 2, 3)
    assert rcm.shifts == (1, 3)  # from i - 1 and from i + 1
    assert rcm.bytes_per_product() * 3 < given.bytes_per_product()


def test_one_device_matches_bcoo():
    """On a mesh of one device there is no halo: values and the gradient of the
    edge weights (through `to_partitioned_values`) equal the BCOO matrix's, and
    the conversions between numberings are inverse."""
    n, d = 11, 4
    A = _path_graph(n)
    order = np.random.default_rng(1).permutation(n)
    part = krylovjax.partition_graph(A, 1, order=order)
    op = part.operator(jax.make_mesh((1,), ("x",)))
    x0 = jnp.asarray(np.random.default_rng(2).standard_normal((n, 2)))
    xp = part.to_partitioned(x0)
    np.testing.assert_array_equal(part.from_partitioned(xp), x0)

    def loss(op, w, x0):
        X = krylovjax.krylov(op.with_values(part.to_partitioned_values(w)), x0, d)
        return jnp.sum(jnp.sin(part.from_partitioned(X)))

    def loss_bcoo(w, x0):
        return jnp.sum(
            jnp.sin(krylovjax.krylov(sparse.BCOO((w, A.indices), shape=A.shape), x0, d))
        )

    got = jax.jit(jax.grad(loss, (1, 2)))(op, A.data, xp)
    want = jax.grad(loss_bcoo, (0, 1))(A.data, x0)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12)
    np.testing.assert_allclose(part.from_partitioned(got[1]), want[1], rtol=1e-12)
    np.testing.assert_array_equal(
        part.from_partitioned_values(part.to_partitioned_values(A.data)), A.data
    )


def test_padding_and_out_of_range_entries_are_dropped():
    # As in JAX's products: indices in [-n, 0) count from the end (every other
    # entry here), and entries outside [-n, n) are padding.
    A = _path_graph(6)
    wrapped = A.indices - 6 * (jnp.arange(A.nse, dtype=A.indices.dtype) % 2)[:, None]
    outside = jnp.asarray([[6, 6], [-7, 0]], A.indices.dtype)
    padded = sparse.BCOO(
        (
            jnp.concatenate([A.data, jnp.ones(2)]),
            jnp.concatenate([wrapped, outside]),
        ),
        shape=A.shape,
    )
    part = krylovjax.partition_graph(padded, 1, order=None)
    op = part.operator(jax.make_mesh((1,), ("x",)))
    x = jnp.arange(6.0)
    np.testing.assert_allclose(op(part.to_partitioned(x)), A @ x, rtol=1e-14)

    # The padded matrix's own `data` is accepted; its padding gets a zero gradient.
    def loss(w):
        op2 = op.with_values(part.to_partitioned_values(w))
        return jnp.sum(op2(part.to_partitioned(x)) ** 2)

    grad = jax.grad(loss)(padded.data)
    want = jax.grad(
        lambda w: jnp.sum((sparse.BCOO((w, padded.indices), shape=(6, 6)) @ x) ** 2)
    )(padded.data)
    np.testing.assert_allclose(grad, want, rtol=1e-14)
    assert grad[-2:].tolist() == [0.0, 0.0]


def test_scipy_input_and_graph_conv():
    scipy_sparse = pytest.importorskip("scipy.sparse")
    A = _path_graph(7)
    S = scipy_sparse.coo_matrix(
        (
            np.asarray(A.data),
            (np.asarray(A.indices[:, 0]), np.asarray(A.indices[:, 1])),
        ),
        shape=A.shape,
    )
    part = krylovjax.partition_graph(S, 1)
    op = part.operator(jax.make_mesh((1,), ("x",)))
    conv = krylovjax.nn.KrylovGraphConv(2, 3, 2, key=jax.random.key(0))
    H = jnp.ones((7, 2))
    got = part.from_partitioned(conv(op, part.to_partitioned(H)))
    np.testing.assert_allclose(got, conv(A, H), rtol=1e-12)


def test_errors():
    A = _path_graph(6)
    mesh = jax.make_mesh((1,), ("x",))
    with pytest.raises(ValueError, match=r"partition_graph\(order=...\)"):
        krylovjax.partition_graph(A, 2, order="metis")
    with pytest.raises(ValueError, match=r"permutation of range\(6\)"):
        krylovjax.partition_graph(A, 2, order=np.zeros(6, int))
    with pytest.raises(
        ValueError, match=r"num_parts=...\)` must be an integer >= 1; got 0"
    ):
        krylovjax.partition_graph(A, 0)
    with pytest.raises(TypeError, match=r"partition_graph\(A=...\)` must be"):
        krylovjax.partition_graph(np.eye(3), 1)
    with pytest.raises(TypeError, match="concrete indices"):
        jax.jit(
            lambda d: krylovjax.partition_graph(
                sparse.BCOO((d, A.indices), shape=A.shape), 1
            )
        )(A.data)
    integer = sparse.BCOO((jnp.ones(A.nse, jnp.int32), A.indices), shape=A.shape)
    with pytest.raises(TypeError, match=r"partition_graph\(A=...\)` must have a float"):
        krylovjax.partition_graph(integer, 1)
    part = krylovjax.partition_graph(A, 2)
    with pytest.raises(ValueError, match="axis of 2 devices"):
        part.operator(mesh)
    part = krylovjax.partition_graph(A, 1)
    op = part.operator(mesh)
    with pytest.raises(ValueError, match="must be applied to an array with 6 rows"):
        op(jnp.ones(5))
    with pytest.raises(ValueError, match=r"to_partitioned\(x=...\)` must have 6 rows"):
        part.to_partitioned(jnp.ones(4))
    with pytest.raises(ValueError, match=r"with_values\(values=...\)` must have shape"):
        op.with_values(jnp.ones((1, 3)))
    with pytest.raises(ValueError, match=r"operator\(steps=...\)` must be an integer"):
        part.operator(mesh, steps=0)
    deep = part.operator(mesh, steps=2)
    with pytest.raises(
        ValueError, match="steps=2.*got method='scan', adjoint='custom_jvp'"
    ):
        krylovjax.krylov(deep, jnp.ones(6), 3, adjoint="custom_jvp")
    with pytest.raises(
        TypeError, match="must have a floating-point or complex dtype; got dtype int32"
    ):
        part.to_partitioned_values(jnp.ones(A.nse, jnp.int32))


def test_empty_graph():
    A = sparse.BCOO((jnp.zeros(0), jnp.zeros((0, 2), jnp.int32)), shape=(0, 0))
    part = krylovjax.partition_graph(A, 1)
    op = part.operator(jax.make_mesh((1,), ("x",)))
    X = krylovjax.krylov(op, part.to_partitioned(jnp.zeros((0, 2))), 3)
    assert part.from_partitioned(X).shape == (0, 3, 2)
    assert not np.any(X)
