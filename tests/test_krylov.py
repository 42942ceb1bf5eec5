"""Values and reverse-mode gradients of `krylovjax.krylov`."""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import (
    DTYPES,
    KINDS,
    LAYOUTS,
    METHODS,
    as_mv,
    assert_trees_close,
    grid,
    krylov_loop,
    krylov_scan_reference,
    make_operator,
    random_array,
    random_problem,
    tol,
    vjps,
)
from jax.test_util import check_grads

import krylovjax

N, D = 5, 4


# ---------------------------------------------------------------------- values


# Every dtype once, the layouts in turn (doubling's values in every dtype are in
# test_doubling.py::test_values).
@pytest.mark.parametrize(
    "method, dtype, layout",
    [
        ("scan", jnp.float32, "columns"),
        ("scan", jnp.float64, "rows"),
        ("scan", jnp.complex64, "rows"),
        ("scan", jnp.complex128, "columns"),
    ],
)
def test_values_dense(method, dtype, layout):
    # Blocks, and the values with adjoint="custom_jvp", are covered in
    # test_vjp_layouts_and_blocks_*.
    A, x0 = random_problem(dtype)
    X = jax.jit(
        krylovjax.krylov, static_argnums=2, static_argnames=("layout", "method")
    )(A, x0, D, layout=layout, method=method)
    expected = krylov_loop(lambda x: A @ x, x0, D, layout)
    shape = (N, D) if layout == "columns" else (D, N)
    assert X.shape == shape + x0.shape[1:]
    assert X.dtype == dtype
    assert_trees_close(X, expected, **tol(dtype))


# Every kind once, the methods in turn.
@pytest.mark.parametrize(
    "method, kind",
    [
        ("scan", "dense"),
        ("doubling", "bcoo"),
        ("scan", "closure"),
        ("doubling", "module"),
        ("scan", "method"),
    ],
)
def test_values_operator_kinds_block(method, kind):
    # Single vectors, and adjoint="custom_jvp" for every kind, are covered with values
    # in test_vjp_operator_kinds_*; custom_jvp with a block in test_vjp_layouts_*.
    A, x0 = random_problem(jnp.float64, block=2)
    params, build = make_operator(kind, A)

    @jax.jit
    def both(params, x0):
        X = krylovjax.krylov(build(params), x0, D, method=method)
        return X, krylov_loop(as_mv(build(params)), x0, D)

    X, expected = both(params, x0)
    assert X.shape == (N, D, 2)
    assert_trees_close(X, expected, **tol(jnp.float64))


def test_values_column_block_is_block_krylov_matrix():
    # Both methods in one program.
    A, x0 = random_problem(jnp.float64, block=2)
    Xs = jax.jit(lambda A, x0: [krylovjax.krylov(A, x0, D, method=m) for m in METHODS])(
        A, x0
    )
    expected = np.concatenate(
        [np.linalg.matrix_power(np.asarray(A), k) @ np.asarray(x0) for k in range(D)],
        axis=1,
    )
    for X in Xs:
        np.testing.assert_allclose(
            X.reshape(N, D * 2), expected, rtol=1e-12, atol=1e-12
        )


# Each method with each layout and with a vector and a block, in one program.
DEPTH_ONE_CASES = [
    ("scan", "columns", None),
    ("scan", "rows", 2),
    ("doubling", "columns", 2),
    ("doubling", "rows", None),
]


def test_depth_one_returns_x0_with_new_axis():
    problems = [
        random_problem(jnp.float32, block)[1] for _, _, block in DEPTH_ONE_CASES
    ]
    A, _ = random_problem(jnp.float32)

    @jax.jit
    def run(A, x0s):
        out = []
        for (method, layout, _), x0 in zip(DEPTH_ONE_CASES, x0s, strict=True):
            X = krylovjax.krylov(A, x0, 1, layout=layout, method=method)
            grad = jax.grad(
                lambda x, m=method: krylovjax.krylov(A, x, 1, method=m).sum()
            )(x0)
            out.append((X, grad))
        return out

    for (_, layout, _), x0, (X, grad) in zip(
        DEPTH_ONE_CASES, problems, run(A, problems), strict=True
    ):
        axis = 1 if layout == "columns" else 0
        np.testing.assert_array_equal(X, jnp.expand_dims(x0, axis))
        assert X.dtype == jnp.float32
        np.testing.assert_array_equal(grad, jnp.ones_like(x0))


def test_numpy_matrix_and_dtype_promotion():
    # Both methods in one program; the NumPy matrix is a constant of the trace, so
    # krylov receives it as a NumPy array.
    A, x0 = random_problem(jnp.float64)
    A_np = np.asarray(A)
    # A complex matrix with a real start vector gives a complex Krylov matrix.
    Ac = A.astype(jnp.complex128) * (1 + 0.5j)

    @jax.jit
    def run(x0):
        return [
            (
                krylovjax.krylov(A_np, x0, D, method=m),
                krylovjax.krylov(Ac, x0, D, method=m),
            )
            for m in METHODS
        ]

    expected = krylov_loop(lambda x: A @ x, x0, D)
    expected_c = krylov_loop(lambda x: Ac @ x, x0.astype(jnp.complex128), D)
    for X, Xc in run(x0):
        assert_trees_close(X, expected, **tol(jnp.float64))
        assert Xc.dtype == jnp.complex128
        assert_trees_close(Xc, expected_c, **tol(jnp.float64))


# ------------------------------------------------------------------- gradients


def _krylov_fn(build, method, adjoint="custom_vjp", layout="columns", d=D):
    def f(params, x0):
        return krylovjax.krylov(
            build(params), x0, d, layout=layout, adjoint=adjoint, method=method
        )

    return f


def _reference_fn(build, layout="columns", d=D):
    def f(params, x0):
        return krylov_scan_reference(as_mv(build(params)), x0, d, layout)

    return f


# The scan with both rules and every kind, in one program per kind, in a real and a
# complex dtype in turn; doubling with every kind is in
# test_doubling.py::test_vjp_against_scan.
KIND_CASES = [
    (kind, (jnp.float32, jnp.complex128)[i % 2]) for i, kind in enumerate(KINDS)
]


@pytest.mark.parametrize("kind, dtype", KIND_CASES)
def test_vjp_operator_kinds_against_scan_autodiff(kind, dtype):
    A, x0 = random_problem(dtype)
    params, build = make_operator(kind, A)
    fs = [
        _reference_fn(build),
        _krylov_fn(build, "scan", "autodiff"),
        _krylov_fn(build, "scan", "custom_vjp"),
        _krylov_fn(build, "scan", "custom_jvp"),
    ]
    (out_ref, grads_ref), (_, grads_autodiff), *ours = vjps(fs, (params, x0), jr.key(7))
    assert_trees_close(grads_autodiff, grads_ref, **tol(dtype))
    for out, grads in ours:
        assert_trees_close(out, out_ref, **tol(dtype))
        assert_trees_close(grads, grads_ref, **tol(dtype))
        # Every array the operator holds receives a nonzero gradient.
        for leaf in jax.tree_util.tree_leaves(grads[0]):
            assert np.all(np.isfinite(leaf)) and np.any(leaf != 0)


# The scan's custom_vjp in every dtype; custom_jvp in one real and one complex dtype
# (its float64 and complex128 gradients are also checked by finite differences);
# the layouts in turn. Doubling with a block in every dtype is in
# test_doubling.py::test_vjp_against_scan, in both layouts in
# test_doubling.py::test_vjp_both_reverse_schemes_every_depth.
LAYOUT_CASES = [("scan", "custom_vjp", dtype) for dtype in DTYPES]
LAYOUT_CASES += [("scan", "custom_jvp", dt) for dt in (jnp.float32, jnp.complex128)]
LAYOUT_CASES = [(*case, LAYOUTS[i % 2]) for i, case in enumerate(LAYOUT_CASES)]


@pytest.mark.parametrize(("method", "adjoint", "dtype", "layout"), LAYOUT_CASES)
def test_vjp_layouts_and_blocks_against_scan_autodiff(method, adjoint, dtype, layout):
    A, x0 = random_problem(dtype, block=3)
    build = lambda p: p  # noqa: E731
    fs = [
        _krylov_fn(build, method, adjoint, layout=layout),
        _reference_fn(build, layout),
    ]
    (out, grads), (out_ref, grads_ref) = vjps(fs, (A, x0), jr.key(11))
    assert_trees_close(out, out_ref, **tol(dtype))
    assert_trees_close(grads, grads_ref, **tol(dtype))


@grid(method=METHODS, adjoint=("custom_vjp", "custom_jvp"))
def test_vjp_accepts_numpy_cotangent(method, adjoint):
    # With layout="rows" the cotangent reaches the reverse pass unconverted, so a
    # NumPy cotangent must not be indexed by a traced step counter (with "columns"
    # it is converted by the transpose of the layout's `moveaxis`).
    layout = "rows"
    A, x0 = random_problem(jnp.float64)
    f = _krylov_fn(lambda p: p, method, adjoint, layout=layout)
    out, vjp = jax.vjp(f, A, x0)
    ct = np.asarray(random_array(jr.key(4), out.shape, out.dtype))
    _, expected = jax.vjp(_reference_fn(lambda p: p, layout), A, x0)
    assert_trees_close(vjp(ct), expected(jnp.asarray(ct)), **tol(jnp.float64))


# Each kind, method and rule once (the defaults with x0 alone for dense, BCOO and
# callable operators are in test_defaults.py::test_every_chunking_matches_autodiff).
@pytest.mark.parametrize(
    "method, kind, adjoint",
    [
        ("scan", "closure", "custom_jvp"),
        ("doubling", "dense", "custom_vjp"),
        ("scan", "module", "custom_vjp"),
    ],
)
def test_grad_of_one_argument(method, kind, adjoint):
    # Differentiating only x0 (operator not perturbed) or only the operator.
    A, x0 = random_problem(jnp.float64)
    params, build = make_operator(kind, A)
    ct = random_array(jr.key(5), (N, D), jnp.float64)

    def loss(f):
        return lambda p, x: jnp.sum(ct * f(p, x))

    f, ref = _krylov_fn(build, method, adjoint), _reference_fn(build)

    @jax.jit
    def grads(params, x0):
        return [
            (
                jax.grad(loss(f), argnums)(params, x0),
                jax.grad(loss(ref), argnums)(params, x0),
            )
            for argnums in (0, 1)
        ]

    for got, want in grads(params, x0):
        assert_trees_close(got, want, **tol(jnp.float64))


# Forward mode raises for a custom_vjp (see test_transforms.py), so only its reverse
# mode is checked; custom_jvp must pass both.
MODES = {"custom_vjp": ["rev"], "custom_jvp": ["fwd", "rev"], "autodiff": ["rev"]}


# Each rule of the scan, each operator family once; doubling's are in
# test_doubling.py::test_grads_finite_differences.
@pytest.mark.parametrize(
    "method, kind, adjoint",
    [
        ("scan", "dense", "custom_vjp"),
        ("scan", "bcoo", "custom_jvp"),
        ("scan", "method", "custom_jvp"),
    ],
)
def test_grads_finite_differences(method, kind, adjoint):
    # "closure" and "module" reach the same code path as "method" (a callable).
    A, x0 = random_problem(jnp.float64, n=4)
    params, build = make_operator(kind, A)
    f = jax.jit(_krylov_fn(build, method, adjoint, d=3))
    # First order: second derivatives are checked against autodiff in
    # test_transforms.py::test_krylov_forward_mode (jax.hessian of every rule).
    check_grads(f, (params, x0), order=1, modes=MODES[adjoint])


# Doubling's is test_doubling.py::test_grads_finite_differences (its complex case).
@pytest.mark.parametrize(
    "method, adjoint", [("scan", "custom_vjp"), ("scan", "custom_jvp")]
)
def test_grads_finite_differences_complex_block(method, adjoint):
    A, x0 = random_problem(jnp.complex128, block=2, n=3)
    f = jax.jit(_krylov_fn(lambda p: p, method, adjoint, layout="columns", d=3))
    check_grads(f, (A, x0), order=1, modes=MODES[adjoint])


SUM_LOSS_CASES = [
    ("scan", "custom_vjp"),
    ("scan", "custom_jvp"),
    ("doubling", "custom_vjp"),
]


def test_sum_loss_closed_form():
    # The motivating case: n = 3, d = 10, loss = sum of the Krylov matrix; every
    # method and rule in one program.
    n, d = 3, 10
    A, x0 = random_problem(jnp.float64, n=n, seed=1)

    def loss(method, adjoint):
        def f(A, x0):
            return krylovjax.krylov(A, x0, d, method=method, adjoint=adjoint).sum()

        return f

    grads = jax.jit(
        lambda A, x0: [
            jax.grad(loss(*c), argnums=(0, 1))(A, x0) for c in SUM_LOSS_CASES
        ]
    )(A, x0)

    An, xn = np.asarray(A, np.float64), np.asarray(x0, np.float64)
    xs = [np.linalg.matrix_power(An, k) @ xn for k in range(d)]
    # lam_i = sum_{k=0}^{d-1-i} (A^T)^k 1, the adjoint of the sum loss.
    lam = [
        sum(np.linalg.matrix_power(An.T, k) @ np.ones(n) for k in range(d - i))
        for i in range(d)
    ]
    expected_x0 = lam[0]
    expected_A = sum(np.outer(lam[i], xs[i - 1]) for i in range(1, d))
    # A dropped x0 gradient (zeros) or only the direct term (ones) must not pass.
    assert not np.allclose(expected_x0, np.ones(n))
    assert not np.allclose(expected_x0, np.zeros(n))

    for case, (grad_A, grad_x0) in zip(SUM_LOSS_CASES, grads, strict=True):
        np.testing.assert_allclose(
            grad_x0, expected_x0, rtol=1e-12, atol=1e-12, err_msg=str(case)
        )
        np.testing.assert_allclose(
            grad_A, expected_A, rtol=1e-12, atol=1e-12, err_msg=str(case)
        )


# ------------------------------------------------- the custom rule really runs


def test_custom_rule_runs_numerically():
    # float32, moderately sized: the hand-written rule sums in a different order
    # than autodiff through the scan, so the results agree but are not bitwise equal.
    n, d = 48, 24
    A, x0 = random_problem(jnp.float32, n=n, seed=2)
    build = lambda p: p  # noqa: E731
    fs = [
        _krylov_fn(build, "scan", "autodiff", d=d),
        _krylov_fn(build, "scan", "custom_vjp", d=d),
        _krylov_fn(build, "scan", "custom_jvp", d=d),
    ]
    (_, autodiff), *customs = vjps(fs, (A, x0), jr.key(3))
    for _, custom in customs:
        assert_trees_close(custom, autodiff, rtol=1e-4, atol=1e-4)
        assert not all(
            np.array_equal(a, b) for a, b in zip(custom, autodiff, strict=True)
        )


def test_auto_method_with_custom_jvp_uses_scan():
    # A small matrix and a long sequence, where "auto" picks doubling for the other
    # adjoints; with custom_jvp it must run the scan with its rule. Forward mode
    # works (doubling has no custom_jvp), the values are not doubling's (which
    # differ from the scan's in the last bits) and the gradient is not plain
    # autodiff's (which sums in another order).
    n = 4
    A, x0 = random_problem(jnp.float64, n=n, seed=4)
    A = A / jnp.linalg.norm(A, 2)
    depths = (64, 256, 1024, 4096)
    d = next(d for d in depths if krylovjax.auto_method(A, x0, d) == "doubling")
    tangents = (random_array(jr.key(1), A.shape, A.dtype), x0)
    ct = random_array(jr.key(2), (n, d), jnp.float64)

    @jax.jit
    def run(A, x0):
        auto = _krylov_fn(lambda p: p, "auto", "custom_jvp", d=d)
        ref = _reference_fn(lambda p: p, d=d)
        plain = _krylov_fn(lambda p: p, "scan", "autodiff", d=d)
        return (
            jax.jvp(auto, (A, x0), tangents),
            jax.jvp(ref, (A, x0), tangents),
            krylovjax.krylov(A, x0, d, method="doubling"),
            jax.vjp(auto, A, x0)[1](ct),
            jax.vjp(plain, A, x0)[1](ct),
        )

    (out, t_out), (out_ref, t_ref), doubling, grads, grads_plain = run(A, x0)
    assert_trees_close((out, t_out), (out_ref, t_ref), **tol(jnp.float64))
    assert_trees_close(doubling, out, **tol(jnp.float64))
    assert not np.array_equal(doubling, out)
    assert_trees_close(grads, grads_plain, **tol(jnp.float64))
    assert not all(
        np.array_equal(a, b) for a, b in zip(grads, grads_plain, strict=True)
    )
