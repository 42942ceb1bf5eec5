"""`krylov(method="doubling")`: values, both adjoints, transforms, and `"auto"`."""

import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from helpers import (
    assert_trees_close,
    krylov_loop,
    make_operator,
    random_array,
    random_like,
    random_problem,
    scalar_loss,
    temp_bytes,
    tol,
    unchecked,
)
from jax.experimental import sparse
from jax.test_util import check_grads

import krylovjax

N = 5


# ---------------------------------------------------------------------- values


_krylov = jax.jit(krylovjax.krylov, static_argnames=("d", "layout", "method"))


# Every dtype once, with the layouts and block shapes in turn.
@pytest.mark.parametrize(
    "dtype, layout, block",
    [
        (jnp.float32, "columns", None),
        (jnp.float64, "rows", 3),
        (jnp.complex64, "columns", 3),
        (jnp.complex128, "rows", None),
    ],
)
def test_values_dense(dtype, layout, block):
    A, x0 = random_problem(dtype, block)
    got = _krylov(A, x0, d=7, layout=layout, method="doubling")
    want = krylov_loop(lambda x: A @ x, x0, 7, layout)
    assert got.dtype == want.dtype
    assert_trees_close(got, want, **tol(dtype))


DEPTHS_VALUES = (1, 2, 3, 4, 16, 17)


def test_values_depths():
    # Every d mod 4 and both sides of a power of two, in one program.
    A, x0 = random_problem(jnp.float64)
    got = jax.jit(
        lambda A, x0: [
            krylovjax.krylov(A, x0, d, method="doubling") for d in DEPTHS_VALUES
        ]
    )(A, x0)
    for d, X in zip(DEPTHS_VALUES, got, strict=True):
        want = krylov_loop(lambda x: A @ x, x0, d)
        assert_trees_close(X, want, **tol(jnp.float64), err_msg=f"d={d}")


@pytest.mark.parametrize("dtype, block", [(jnp.float64, None), (jnp.complex64, 2)])
def test_values_bcoo(dtype, block):
    A, x0 = random_problem(dtype, block, n=7)
    params, build = make_operator("bcoo", A)
    got, B = jax.jit(
        lambda p, x0: (
            krylovjax.krylov(build(p), x0, 11, method="doubling"),
            build(p).todense(),
        )
    )(params, x0)
    assert_trees_close(got, krylov_loop(lambda x: B @ x, x0, 11), **tol(dtype))


def test_dtype_promotion():
    A, x0 = random_problem(jnp.complex64)
    got, want = jax.jit(
        lambda A, x: [krylovjax.krylov(A, x, 6, method=m) for m in ("doubling", "scan")]
    )(A, x0.real)
    assert got.dtype == jnp.complex64
    assert_trees_close(got, want, **tol(jnp.complex64))


# ------------------------------------------------------------------ gradients


# Every method and rule once, the layouts and depths in turn; doubling's reverse pass
# at n = 5 with one level (d = 2, the powers fit in memory) and with three (d = 5,
# where they do not).
@pytest.mark.parametrize(
    ("method", "adjoint", "layout", "d"),
    [
        ("doubling", "custom_vjp", "columns", 2),
        ("doubling", "custom_vjp", "rows", 5),
        ("doubling", "autodiff", "rows", 5),
        ("scan", "custom_vjp", "columns", 5),
        ("scan", "custom_jvp", "rows", 2),
        ("scan", "autodiff", "columns", 5),
    ],
)
def test_empty_block(method, adjoint, layout, d):
    # A block of zero columns: an empty Krylov matrix and zero gradients, the same
    # by both methods.
    A, _ = random_problem(jnp.float64)
    x0 = jnp.zeros((N, 0))

    def f(A, x0):
        return krylovjax.krylov(A, x0, d, layout=layout, method=method, adjoint=adjoint)

    out, (grad_A, grad_x0) = jax.jit(
        lambda A, x0: (f(A, x0), jax.grad(lambda A, x0: f(A, x0).sum(), (0, 1))(A, x0))
    )(A, x0)
    assert out.shape == ((N, d, 0) if layout == "columns" else (d, N, 0))
    assert grad_A.shape == (N, N)
    assert not grad_A.any()
    assert grad_x0.shape == (N, 0)


def _vjp_pair(kind, dtype, d, block, layout="columns", n=N, seed=0, pairs=None):
    """VJPs of doubling (custom rule), scan (autodiff) and doubling (autodiff), or of
    `pairs` of (method, adjoint), at one random cotangent."""
    A, x0 = random_problem(dtype, block, n=n, seed=seed)
    params, build = make_operator(kind, A)

    def f(method, adjoint):
        def fn(p, x):
            return krylovjax.krylov(
                build(p), x, d, layout=layout, method=method, adjoint=adjoint
            )

        return fn

    ct = random_like(
        jr.key(seed + 7), jax.eval_shape(f("scan", "autodiff"), params, x0)
    )

    if pairs is None:
        pairs = [
            ("doubling", "custom_vjp"),
            ("scan", "autodiff"),
            ("doubling", "autodiff"),
        ]

    @jax.jit
    def vjps(params, x0, ct):
        return [jax.vjp(f(*pair), params, x0)[1](ct) for pair in pairs]

    return vjps(params, x0, ct)


# Every operator kind and every dtype once, vector and block in turn.
@pytest.mark.parametrize(
    "kind, dtype, block",
    [
        ("dense", jnp.float32, None),
        ("dense", jnp.complex128, 3),
        ("bcoo", jnp.complex64, 3),
        ("closure", jnp.float64, 3),
        ("module", jnp.complex128, None),
        ("method", jnp.float32, 3),
    ],
)
def test_vjp_against_scan(kind, dtype, block):
    custom, scan, autodiff = _vjp_pair(kind, dtype, 9, block)
    assert_trees_close(custom, scan, **tol(dtype))
    assert_trees_close(autodiff, scan, **tol(dtype))


# Both schemes of the reverse pass at every d mod 4, vector and block and the
# layouts in turn. It transposes the forward levels while the ceil(log2 d) powers
# fit, n (ceil(log2 d) - 2) <= 2 d b: every case at n = 5 (and every d <= 4). It
# runs the Hillis-Steele scan otherwise: the cases at n = 12 to 34.
REVERSE_CASES = [
    (5, 2, 2, "columns"),
    (5, 3, None, "rows"),
    (5, 5, 2, "rows"),
    (5, 16, 2, "columns"),
    (12, 5, None, "columns"),
    (26, 6, 2, "rows"),
    (15, 7, None, "columns"),
    (34, 8, 2, "rows"),
]


@pytest.mark.parametrize("n, d, block, layout", REVERSE_CASES)
def test_vjp_both_reverse_schemes_every_depth(n, d, block, layout):
    pairs = [("doubling", "custom_vjp"), ("scan", "autodiff")]
    custom, scan = _vjp_pair("dense", jnp.float64, d, block, layout, n=n, pairs=pairs)
    assert_trees_close(custom, scan, **tol(jnp.float64))


def test_custom_rule_runs():
    # Doubling's own reverse pass sums in another order than JAX's differentiation
    # of the forward levels: close, but not bitwise equal.
    A, x0 = random_problem(jnp.float64, n=6)
    W = random_array(jr.key(5), (6, 40), jnp.float64)

    def grad(adjoint):
        def loss(A, x0):
            X = krylovjax.krylov(A, x0, 40, method="doubling", adjoint=adjoint)
            return jnp.sum(X * W)

        return jax.grad(loss, (0, 1))(A, x0)

    custom, plain = jax.jit(lambda: (grad("custom_vjp"), grad("autodiff")))()
    assert_trees_close(custom, plain, **tol(jnp.float64))
    assert not all(jnp.array_equal(a, b) for a, b in zip(custom, plain, strict=True))


@pytest.mark.parametrize(
    ("kind", "block", "adjoint"),
    [
        ("dense", 2, "custom_vjp"),
        ("bcoo", None, "custom_vjp"),
        ("bcoo", 2, "autodiff"),
    ],
)
def test_grads_finite_differences(kind, block, adjoint):
    A, x0 = random_problem(jnp.float64, block, n=4)
    params, build = make_operator(kind, A)

    @jax.jit
    def f(p, x):
        return krylovjax.krylov(build(p), x, 6, method="doubling", adjoint=adjoint)

    # First order: second derivatives of doubling's rule are checked against
    # autodiff in test_jit_and_grad_of_grad and in
    # test_transforms.py::test_krylov_forward_mode (jax.hessian).
    check_grads(f, (params, x0), order=1, modes=["rev"])


def test_grads_finite_differences_complex():
    A, x0 = random_problem(jnp.complex128, 2, n=3)

    @jax.jit
    def f(A, x):
        return krylovjax.krylov(A, x, 5, layout="rows", method="doubling")

    check_grads(f, (A, x0), order=1, modes=["rev"])


def test_forward_mode_with_autodiff_adjoint():
    A, x0 = random_problem(jnp.float64)

    @jax.jit
    def f(x):
        return krylovjax.krylov(A, x, 7, method="doubling", adjoint="autodiff")

    tangent = random_array(jr.key(3), x0.shape, x0.dtype)
    _, out = jax.jvp(f, (x0,), (tangent,))
    assert_trees_close(out, f(tangent), **tol(jnp.float64))


# ----------------------------------------------------------------- transforms


def _weighted_loss(method, d=8):
    W = random_array(jr.key(5), (N, d), jnp.float64)

    def loss(A, x):
        X = krylovjax.krylov(A, x, d, method=method)
        return scalar_loss(X, "weights_argument", W)

    return loss


def test_jit_and_grad_of_grad():
    A, x0 = random_problem(jnp.float64)

    def hessian_like(method):
        inner = jax.grad(_weighted_loss(method), argnums=(0, 1))
        return jax.jit(jax.grad(lambda A, x: jnp.sum(inner(A, x)[1] ** 2), (0, 1)))

    assert_trees_close(
        hessian_like("doubling")(A, x0), hessian_like("scan")(A, x0), **tol(jnp.float64)
    )


def _krylov_6(method):
    return lambda A, x: krylovjax.krylov(A, x, 6, method=method)


@pytest.mark.parametrize("in_axes", [(None, 0), (0, None), (0, 0)])
def test_vmap_over_x0_and_A(in_axes):
    As = jnp.stack([random_problem(jnp.float64, seed=s)[0] for s in range(3)])
    xs = jnp.stack([random_problem(jnp.float64, seed=s)[1] for s in range(3)])
    args = (As[0] if in_axes[0] is None else As, xs[0] if in_axes[1] is None else xs)
    makes = (_krylov_6, lambda m: jax.grad(_weighted_loss(m), (0, 1)))

    @jax.jit
    def run(*args):
        return [
            [jax.vmap(make(m), in_axes)(*args) for m in ("doubling", "scan")]
            for make in makes
        ]

    for got, want in run(*args):
        assert_trees_close(got, want, **tol(jnp.float64))


def test_checkpoint():
    A, x0 = random_problem(jnp.float64)
    got, want = jax.jit(
        lambda A, x0: (
            jax.grad(jax.checkpoint(_weighted_loss("doubling")), (0, 1))(A, x0),
            jax.grad(_weighted_loss("scan"), (0, 1))(A, x0),
        )
    )(A, x0)
    assert_trees_close(got, want, **tol(jnp.float64))


def test_reverse_pass_memory_has_no_per_level_copies():
    # XLA's compiled memory analysis of jit(grad): a buffer per doubling level would
    # cost about log2(d) = 10 times the (n, d) buffer; allow 6 buffers and 8 matrices.
    n, d = 32, 1024
    A = jax.ShapeDtypeStruct((n, n), jnp.float32)
    x0 = jax.ShapeDtypeStruct((n,), jnp.float32)

    def loss(A, x0):
        return jnp.sum(jnp.sin(krylovjax.krylov(A, x0, d, method="doubling")))

    temp = temp_bytes(jax.grad(loss, (0, 1)), A, x0)
    assert temp <= 4 * (6 * n * d + 8 * n * n), temp


# ------------------------------------------------------------------ bad input


# A vector x0 with a callable is in test_vjp_against_scan.
@pytest.mark.parametrize("shape", [(5, 3), (2, 3, 2)])
def test_callable_is_materialised(shape):
    # A callable's matrix acts on x0 flattened, so a map that mixes the columns of a
    # block (or any axes) is doubled exactly as the scan iterates it.
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    A = jax.random.normal(k1, (shape[0], shape[0]), jnp.float64) / 3
    B = jax.random.normal(k2, shape[1:] * 2, jnp.float64) / 2
    x0 = jax.random.normal(k3, shape, jnp.float64)
    axes = len(shape) - 1

    def loss(A, B, x0, method):
        def op(x):
            return jnp.tensordot(A, jnp.tensordot(x, B, axes) if axes else x, 1)

        return jnp.sum(jnp.sin(krylovjax.krylov(op, x0, 6, method=method)))

    value = jax.value_and_grad(loss, (0, 1, 2))
    got, want = jax.jit(
        lambda A, B, x0: (value(A, B, x0, "doubling"), value(A, B, x0, "scan"))
    )(A, B, x0)
    assert_trees_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("d", [0, -2])
def test_bad_depth(d):
    A, x0 = random_problem(jnp.float32)
    with pytest.raises(ValueError, match=r"krylov\(d=\.\.\.\)"):
        krylovjax.krylov(A, x0, d, method="doubling")


def test_bad_method():
    A, x0 = random_problem(jnp.float32)
    with pytest.raises(ValueError, match=r"krylov\(method=\.\.\.\).*'doubling'"):
        unchecked(krylovjax.krylov)(A, x0, 4, method="doubled")


# ------------------------------------------------------------------------ auto


DEPTHS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
AUTO_DTYPES = (jnp.float32, jnp.float64, jnp.complex64, jnp.complex128)


@pytest.mark.parametrize("dtype", AUTO_DTYPES)
@pytest.mark.parametrize("n", [2, 4, 16, 64, 256, 512])
def test_auto_method_is_monotone_in_depth(dtype, n):
    # Doubling pays off for long sequences: once auto picks it at some d, it picks
    # it at every larger d; and a long enough sequence of a small matrix gets it.
    A = jnp.zeros((n, n), dtype)
    x0 = jnp.ones(n, dtype)
    picks = [krylovjax.auto_method(A, x0, d) for d in DEPTHS]
    first = picks.index("doubling") if "doubling" in picks else len(picks)
    assert all(p == "scan" for p in picks[:first])
    assert all(p == "doubling" for p in picks[first:])
    if n <= 16:
        assert picks[-1] == "doubling"
    assert picks[0] == "scan"


@pytest.mark.parametrize("dtype", AUTO_DTYPES)
def test_auto_method_large_matrix_is_scan(dtype):
    # Beyond the measured sizes (n > 512) the O(n^3 log d) powers never pay off.
    A, x0 = jnp.zeros((1024, 1024), dtype), jnp.ones(1024, dtype)
    assert all(krylovjax.auto_method(A, x0, d) == "scan" for d in DEPTHS)


@pytest.mark.parametrize("n", [4, 16, 64, 256])
@pytest.mark.parametrize("block", [2, 8])
def test_auto_method_block_counts_at_least_as_long(n, block):
    # A block of b vectors makes each scan step a matrix product: doubling for a
    # vector implies doubling for the block at the same d.
    A = jnp.zeros((n, n))
    for d in DEPTHS:
        if krylovjax.auto_method(A, jnp.ones(n), d) == "doubling":
            assert krylovjax.auto_method(A, jnp.ones((n, block)), d) == "doubling"


@pytest.mark.parametrize("kind", ["bcoo", "callable"])
@pytest.mark.parametrize("d", [16, 1024, 8192])
def test_auto_method_sparse_and_callable_is_scan(kind, d):
    A = jnp.eye(4) / 2
    A = sparse.BCOO.fromdense(A) if kind == "bcoo" else (lambda x, A=A: A @ x)
    assert krylovjax.auto_method(A, jnp.ones(4), d) == "scan"


def test_auto_method_checks_its_arguments():
    with pytest.raises(ValueError, match=r"`auto_method\(x0=...\)` must have first"):
        unchecked(krylovjax.auto_method)(jnp.eye(4), jnp.ones(3), 16)
    with pytest.raises(TypeError, match=r"`auto_method\(d=...\)`"):
        unchecked(krylovjax.auto_method)(jnp.eye(4), jnp.ones(4), 2.5)


def test_auto_runs_the_chosen_method():
    # auto gives exactly what the method it names gives, values and gradients.
    A, x0 = random_problem(jnp.float32, n=4)
    for d in (16, 1024):
        chosen = krylovjax.auto_method(A, x0, d)

        def run(method, d=d):
            def loss(A, x0):
                return krylovjax.krylov(A, x0, d, method=method).sum()

            return krylovjax.krylov(A, x0, d, method=method), jax.grad(loss, (0, 1))(
                A, x0
            )

        auto, named = jax.jit(lambda A, x0, m=chosen: (run("auto"), run(m)))(A, x0)
        for a, b in zip(jax.tree.leaves(auto), jax.tree.leaves(named), strict=True):
            assert jnp.array_equal(a, b)
    assert krylovjax.auto_method(A, x0, 1024) == "doubling"
