"""BCOO matrices at any shape of pattern: the chunked sparse path against dense."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, scalar_loss, temp_bytes
from jax.experimental import sparse

import krylovjax

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


def _krylov_loss(matrix, adjoint=None):
    """`(data, indices, x0) ->` the sum of `sin` of the Krylov matrix of
    `matrix(data, indices)`."""

    def loss(data, indices, x0):
        return scalar_loss(
            krylovjax.krylov(matrix(data, indices), x0, D, adjoint=adjoint)
        )

    return loss


# Widths: a vector, and a block so wide that a chunk of the product holds fewer
# entries than the matrix stores (150 + 7, not a multiple of the chunk); a narrow
# block takes the same path as the wide one, in one chunk.
WIDTHS = [None, 2**14]


def _krylov_fn(matrix, indices, adjoint=None):
    """`(data, x0) ->` the Krylov matrix of `matrix(data, indices)`."""

    def f(data, x0):
        return krylovjax.krylov(matrix(data, indices), x0, D, adjoint=adjoint)

    return f


@pytest.mark.parametrize("b", WIDTHS)
def test_values_and_derivatives_match_dense(b):
    # The Krylov matrix, the gradient of the stored values and of x0 under each of
    # krylov's rules, and forward mode, against plain autodiff of the dense matrix
    # with duplicates added up. One program.
    data, indices, x0 = _problem(b)
    tangents = (jnp.cos(data), jnp.ones_like(x0))

    def derivatives(matrix, adjoints):
        fs = [_krylov_fn(matrix, indices, adjoint) for adjoint in adjoints]
        return (
            fs[0](data, x0),
            [
                jax.grad(lambda *p, f=f: scalar_loss(f(*p)), (0, 1))(data, x0)
                for f in fs
            ],
            jax.jvp(fs[0], (data, x0), tangents)[1],
        )

    @jax.jit
    def run(data, x0):
        return (
            derivatives(_sparse, (None, "custom_vjp", "autodiff")),
            derivatives(_dense, ("autodiff",)),
        )

    (X, grads, jvp), (X_d, (grad_d,), jvp_d) = run(data, x0)
    assert_trees_close(X, X_d, rtol=1e-12, atol=1e-12)
    for grad in grads:
        assert_trees_close(grad, grad_d, rtol=1e-11, atol=1e-11)
    assert_trees_close(jvp, jvp_d, rtol=1e-12, atol=1e-12)


def test_second_derivatives_match_dense():
    # The derivatives of the product's derivative rules, for a block: Hessian-vector
    # products, forward over reverse and reverse over reverse, against plain
    # autodiff of the dense matrix. (With a vector: test_defaults.py, whose BCOO
    # case runs them with the reverse pass's chunks.) One program.
    data, indices, x0 = _problem(3, seed=3)
    v = (jnp.sin(data), jnp.cos(x0))

    def grad(matrix, adjoint=None):
        f = _krylov_fn(matrix, indices, adjoint)
        return jax.grad(lambda p: scalar_loss(f(*p)))

    def inner(p):
        g = grad(_sparse)(p)
        return sum(jnp.vdot(a, b) for a, b in zip(g, v, strict=True))

    @jax.jit
    def run(p):
        return (
            jax.jvp(grad(_sparse), (p,), (v,))[1],
            jax.grad(inner)(p),
            jax.jvp(grad(_dense, "autodiff"), (p,), (v,))[1],
        )

    fwd_rev, rev_rev, want = run((data, x0))
    assert_trees_close(fwd_rev, want, rtol=1e-11, atol=1e-11)
    assert_trees_close(rev_rev, want, rtol=1e-11, atol=1e-11)


def test_empty_matrix():
    indices = jnp.zeros((0, 2), jnp.int32)
    data = jnp.zeros((0,), jnp.float64)
    x0 = jnp.ones((N, 2), jnp.float64)

    @jax.jit
    def run(data, x0):
        X = krylovjax.krylov(_sparse(data, indices), x0, D)
        return X, jax.grad(_krylov_loss(_sparse), (0, 2))(data, indices, x0)

    X, grad = run(data, x0)
    assert_trees_close(X[:, 1:], jnp.zeros((N, D - 1, 2)), rtol=0, atol=0)
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


def _krylov(A, **options):
    return scalar_loss(krylovjax.krylov(A, _B, 3, **options))


def _lanczos(A, **options):
    return scalar_loss(krylovjax.lanczos(A, _B, 3, **options).diagonal)


# A scalar loss of a matrix and how it is differentiated, for each way a stored
# value's derivative is computed: krylov's reverse pass (the sampled products of a
# chunk of steps at a time; so its custom_vjp and `KrylovGraphConv`), the product's
# tangent (forward mode), and a decomposition's reverse pass (one sampled product
# for the whole basis; so Arnoldi, `funm_action` and `trace_funm`, whose probes
# are a batch of bases).
PADDING_CASES = {
    "krylov": (_krylov, jax.grad),
    "krylov_jacfwd": (_krylov, jax.jacfwd),
    "lanczos": (_lanczos, jax.grad),
}


def test_padding_entries_get_no_gradient():
    # The derivative of every padding value is exactly zero, and that of every
    # stored value the derivative of its entry of the dense matrix. One program.
    padded = _padded(_S)
    rows, columns = np.asarray(sparse.BCOO.fromdense(_S).indices).T

    @jax.jit
    def run(data, S):
        return {
            case: (
                derivative(lambda v, loss=loss: loss(_sparse_like(padded, v)))(data),
                derivative(loss)(S),
            )
            for case, (loss, derivative) in PADDING_CASES.items()
        }

    for case, (got, dense) in run(padded.data, _S).items():
        assert_trees_close(got[_PADDING], jnp.zeros(2), rtol=0, atol=0, err_msg=case)
        want = dense[rows, columns]
        assert_trees_close(got[_KEPT], want, rtol=1e-12, atol=1e-12, err_msg=case)


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


def test_hessian_through_a_callable_that_applies_a_bcoo_matrix():
    # Forward over reverse: the reverse pass takes the VJP of the callable vmapped
    # over a stack of vectors (`param_vjp`, which every function's reverse pass
    # uses for a callable), and `jacfwd` batches it again, in JAX's BCOO rules.
    plain = sparse.BCOO.fromdense(_S)

    def hessian(adjoint):
        def of_data(data):
            A = sparse.BCOO((data, plain.indices), shape=_S.shape)
            return _krylov(lambda x: A @ x, adjoint=adjoint)

        return jax.hessian(of_data)

    got, want = jax.jit(lambda v: (hessian(None)(v), hessian("autodiff")(v)))(
        plain.data
    )
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

    for fn in (jax.grad(loss, (0, 1)), loss):
        temp = temp_bytes(fn, data, x0)
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
    vectors = temp_bytes(jax.grad(loss, argnums), data, x0, indices, W) / (4 * n * b)
    assert vectors < (1.5 if wrt == "x" else 4.5), vectors
