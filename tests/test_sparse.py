"""BCOO matrices at any shape of pattern: the chunked sparse path against dense."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, run_on_four_devices
from jax.experimental import sparse
from jax.test_util import check_grads

import krylovjax
from krylovjax.nn import KrylovGraphConv

N, D = 20, 4


def _pattern(n, nnz, seed):
    """Rows and columns with empty rows, columns never read (isolated nodes),
    duplicate entries and no order."""
    rng = np.random.default_rng(seed)
    rows = rng.choice(np.arange(0, n, 2), nnz)  # odd rows stay empty
    cols = rng.choice(np.arange(n - 3), nnz)  # the last three columns are unused
    rows = np.r_[rows, rows[:7]]  # duplicates
    cols = np.r_[cols, cols[:7]]
    order = rng.permutation(rows.size)
    return jnp.asarray(np.stack([rows[order], cols[order]], 1), jnp.int32)


def _problem(b, nnz=150, seed=0):
    indices = _pattern(N, nnz, seed)
    ka, kx = jax.random.split(jax.random.key(seed))
    data = jax.random.normal(ka, (indices.shape[0],), jnp.float64) / 4
    shape = (N,) if b is None else (N, b)
    x0 = jax.random.normal(kx, shape, jnp.float64)
    return data, indices, x0


def _sparse(data, indices):
    return sparse.BCOO((data, indices), shape=(N, N))


def _dense(data, indices):
    # Duplicates add up, as in a BCOO product.
    return jnp.zeros((N, N), data.dtype).at[indices[:, 0], indices[:, 1]].add(data)


def _loss(matrix, adjoint=None):
    def loss(data, indices, x0):
        X = krylovjax.krylov(matrix(data, indices), x0, D, adjoint=adjoint)
        return jnp.sum(jnp.sin(X))

    return loss


# Widths: a vector, a block, and a block so wide that a chunk of the product holds
# fewer entries than the matrix stores (150 + 7, not a multiple of the chunk).
WIDTHS = [None, 3, 2**14]


@pytest.mark.parametrize("b", WIDTHS)
def test_values_match_dense(b):
    data, indices, x0 = _problem(b)
    got = krylovjax.krylov(_sparse(data, indices), x0, D)
    want = krylovjax.krylov(_dense(data, indices), x0, D)
    assert_trees_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("b", WIDTHS)
@pytest.mark.parametrize("adjoint", [None, "custom_vjp", "autodiff"])
def test_gradients_match_dense(b, adjoint):
    data, indices, x0 = _problem(b, seed=1)
    grad = jax.grad(_loss(_sparse, adjoint), (0, 2))(data, indices, x0)
    want = jax.grad(_loss(_dense, "autodiff"), (0, 2))(data, indices, x0)
    assert_trees_close(grad, want, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("b", [None, 3])
def test_forward_mode_matches_dense(b):
    data, indices, x0 = _problem(b, seed=2)
    tangents = (jnp.cos(data), jnp.ones_like(x0))

    def jvp(matrix):
        def f(data, x0):
            return krylovjax.krylov(matrix(data, indices), x0, D)

        return jax.jvp(f, (data, x0), tangents)

    assert_trees_close(jvp(_sparse), jvp(_dense), rtol=1e-12, atol=1e-12)


def test_finite_differences():
    data, indices, x0 = _problem(3, seed=3)
    loss = _loss(_sparse)
    # Second order too: the derivatives of the product's derivative rules.
    check_grads(
        lambda data, x0: loss(data, indices, x0),
        (data, x0),
        order=2,
        modes=["rev"],
    )


def test_empty_matrix():
    indices = jnp.zeros((0, 2), jnp.int32)
    data = jnp.zeros((0,), jnp.float64)
    x0 = jnp.ones((N, 2), jnp.float64)
    X = krylovjax.krylov(_sparse(data, indices), x0, D)
    assert_trees_close(X[:, 1:], jnp.zeros((N, D - 1, 2)), rtol=0, atol=0)
    grad = jax.grad(_loss(_sparse), (0, 2))(data, indices, x0)
    assert grad[0].shape == (0,)
    assert_trees_close(grad[1], jnp.cos(x0), rtol=1e-15, atol=0)


# A symmetric matrix with 7 entries, and the same matrix with two padding entries
# (which JAX's products ignore) among them, rows still sorted: (3, 3) at the end, as
# `fromdense(S, nse=...)` pads, and (0, 3) after row 0, whose row is in range.
_S = jnp.array([[2.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 4.0]])
_B = jnp.array([1.0, 0.5, -1.0])
_PADDING = np.array([2, 8])
_KEPT = np.array([0, 1, 3, 4, 5, 6, 7])


def _padded(S):
    plain = sparse.BCOO.fromdense(S)
    indices = jnp.zeros((9, 2), plain.indices.dtype).at[_KEPT].set(plain.indices)
    padding = jnp.array([[0, 3], [3, 3]], plain.indices.dtype)
    indices = indices.at[_PADDING].set(padding)
    data = jnp.zeros(9, plain.dtype).at[_KEPT].set(plain.data)
    return sparse.BCOO((data, indices), shape=S.shape, indices_sorted=True)


def _sparse_like(A, data):
    """`A` with the values `data`."""
    return sparse.BCOO(
        (data, A.indices), shape=A.shape, indices_sorted=A.indices_sorted
    )


_CONV = KrylovGraphConv(2, 2, 2, key=jax.random.key(0))


def _losses(**options):
    """A scalar loss of a matrix or callable `A` for each function that builds a
    Krylov basis, `options` (an adjoint) passed to it."""
    return {
        "krylov": lambda A: jnp.sum(jnp.sin(krylovjax.krylov(A, _B, 3, **options))),
        "lanczos": lambda A: jnp.sum(
            jnp.sin(krylovjax.lanczos(A, _B, 3, **options).diagonal)
        ),
        "arnoldi": lambda A: jnp.sum(
            jnp.sin(krylovjax.arnoldi(A, _B, 3, **options).hessenberg)
        ),
        "funm_action": lambda A: jnp.sum(
            krylovjax.funm_action(jnp.exp, A, _B, 3, method="lanczos", **options)
        ),
    }


# A scalar loss of a matrix and how it is differentiated, for each public function
# that takes a BCOO matrix (and krylov's other rules).
PADDING_CASES = {
    **{name: (loss, jax.grad) for name, loss in _losses().items()},
    "krylov_custom_vjp": (_losses(adjoint="custom_vjp")["krylov"], jax.grad),
    "krylov_jacfwd": (_losses()["krylov"], jax.jacfwd),
    "trace_funm": (
        lambda A: krylovjax.trace_funm(jnp.log, A, jax.random.key(1), 3, num_probes=2),
        jax.grad,
    ),
    "KrylovGraphConv": (
        lambda A: jnp.sum(jnp.sin(_CONV(A, jnp.outer(_B, _B[:2])))),
        jax.grad,
    ),
}


@pytest.mark.parametrize("case", list(PADDING_CASES))
def test_padding_entries_get_no_gradient(case):
    loss, derivative = PADDING_CASES[case]

    @jax.jit
    def grad(A):
        return derivative(lambda v: loss(_sparse_like(A, v)))(A.data)

    got = grad(_padded(_S))
    assert_trees_close(got[_PADDING], jnp.zeros(2), rtol=0, atol=0)
    want = grad(sparse.BCOO.fromdense(_S))
    assert_trees_close(got[_KEPT], want, rtol=1e-12, atol=1e-12)


def test_padding_entries_never_read_x():
    # Entries outside the matrix (row, column or both), whose indices clamped into
    # range read the last row of x0, which is infinite; no stored entry reads it,
    # so JAX's product, the Krylov vectors after x0 and the gradient are finite. A
    # negative index counts from the end, as in JAX: (-1, -3) is entry (2, 0).
    S = _S.at[:, 2].set(0.0)
    plain = sparse.BCOO.fromdense(S)
    padding = jnp.array([[0, 3], [3, 0], [3, 3], [-1, -3]], plain.indices.dtype)
    indices = jnp.concatenate([plain.indices, padding])
    data = jnp.concatenate([plain.data, jnp.ones(4)])
    A = sparse.BCOO((data, indices), shape=(3, 3))
    x0 = _B.at[2].set(jnp.inf)
    want = jnp.stack([A @ x0, A @ (A @ x0)], axis=1)
    assert bool(jnp.all(jnp.isfinite(want))), want

    @jax.jit
    def value_and_grad(data):
        def tail(data):
            return krylovjax.krylov(_sparse_like(A, data), x0, 3)[:, 1:]

        return tail(data), jax.grad(lambda data: jnp.sum(tail(data)))(data)

    X, grad = value_and_grad(data)
    assert_trees_close(X, want, rtol=1e-15, atol=0)
    assert bool(jnp.all(jnp.isfinite(grad))), grad
    assert_trees_close(grad[-4:-1], jnp.zeros(3), rtol=0, atol=0)


@pytest.mark.parametrize("name", list(_losses()))
def test_hessian_through_a_callable_that_applies_a_bcoo_matrix(name):
    # Forward over reverse: the reverse pass takes the VJP of the callable vmapped
    # over a stack of vectors, which `jacfwd` batches again, in JAX's BCOO rules.
    plain = sparse.BCOO.fromdense(_S)

    def hessian(loss):
        def of_data(data):
            A = sparse.BCOO((data, plain.indices), shape=_S.shape)
            return loss(lambda x: A @ x)

        return jax.jit(jax.hessian(of_data))(plain.data)

    got = hessian(_losses()[name])
    want = hessian(_losses(adjoint="autodiff")[name])
    assert_trees_close(got, want, rtol=1e-10, atol=1e-12)


def test_memory_is_bounded_by_a_chunk_not_by_the_entries():
    # 100 000 stored entries times 256 features: gathering a feature row for every
    # entry at once, as a batched BCOO product does, would take 102 MB per product.
    n, per_row, b = 2000, 50, 256
    rng = np.random.default_rng(0)
    rows = np.repeat(np.arange(n), per_row)
    indices = jnp.asarray(np.stack([rows, rng.integers(0, n, rows.size)], 1))
    data = jnp.asarray(rng.standard_normal(rows.size), jnp.float32)
    x0 = jnp.ones((n, b), jnp.float32)
    gathered = 4 * rows.size * b
    vector = 4 * n * b

    def loss(data, x0):
        A = sparse.BCOO((data, indices), shape=(n, n))
        return jnp.sum(krylovjax.krylov(A, x0, D) ** 2)

    for fn in (jax.grad(loss, (0, 1)), lambda data, x0: loss(data, x0)):
        compiled = jax.jit(fn).lower(data, x0).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        # The stack and its cotangent, a few vectors and a few chunks of 4 MB: less
        # than half of one gather.
        assert temp < 4 * D * vector + 4 * 2**22 < gathered / 2, (temp, gathered)


@pytest.mark.parametrize("wrt", ["x", "x_and_edge_weights"])
def test_graph_filter_gradient_keeps_few_vectors(wrt):
    # Wide vectors (a chunk holds one) and the loss of a graph filter, sum(X * W)
    # with W broadcast over the nodes. Compiled only, from shapes. The gradient
    # with respect to X needs about one vector of temporary memory and with the
    # edge weights too the two stored vectors x_1, x_2 and two adjoint vectors:
    # XLA once computed every broadcast cotangent row before the forward scan and
    # kept them live across it (3.05 and 8.40 vectors), and x_3 was stored.
    n, per_row, b, d = 40_000, 15, 128, 4
    nnz = n * per_row
    data = jax.ShapeDtypeStruct((nnz,), jnp.float32)
    indices = jax.ShapeDtypeStruct((nnz, 2), jnp.int32)
    x0 = jax.ShapeDtypeStruct((n, b), jnp.float32)
    W = jax.ShapeDtypeStruct((d, b), jnp.float32)

    def loss(data, x0, indices, W):
        A = sparse.BCOO((data, indices), shape=(n, n))
        return jnp.sum(krylovjax.krylov(A, x0, d, layout="rows") * W[:, None])

    argnums = 1 if wrt == "x" else (0, 1)
    compiled = jax.jit(jax.grad(loss, argnums)).lower(data, x0, indices, W).compile()
    vectors = compiled.memory_analysis().temp_size_in_bytes / (4 * n * b)
    assert vectors < (1.5 if wrt == "x" else 4.5), vectors


def test_row_partitioned_graph_matches_one_device():
    # Node features and the adjacency's entries split by rows over four host
    # devices, on both mesh kinds; see `_graph_sharding_script.py`.
    records = run_on_four_devices("_graph_sharding_script.py")
    assert sorted(records) == [
        "Auto-None",
        "Auto-autodiff",
        "Explicit-None",
        "Explicit-autodiff",
        "unplaced-None",
        "unplaced-autodiff",
    ]
    for case, record in records.items():
        if not case.startswith("unplaced"):
            assert record["devices"] == 4, records
        assert max(record["errors"]) < 1e-13, records
