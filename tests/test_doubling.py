"""`krylov(method="doubling")`: values, both adjoints, transforms, and `"auto"`.

The problems are NumPy arrays and the references NumPy loops or the scan, and each
test runs all of its cases in one jitted program: compiling is what the tests spend
their time on. Doubling under jit, grad of grad, checkpoint, and vmap of its forward
pass and of its gradient over both arguments are in
test_transforms.py::test_krylov_transforms_dense (`"doubling"`); its forward modes
with the autodiff adjoint in test_transforms.py::test_krylov_forward_mode.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_trees_close,
    dense_of_numpy,
    krylov_numpy,
    numpy_array,
    numpy_like,
    numpy_operator,
    numpy_problem,
    scalar_loss,
    temp_bytes,
    tol,
    unchecked,
)
from jax.experimental import sparse
from jax.test_util import check_vjp

import krylovjax

N = 5


def _label(case):
    """A case of a table of cases as `dense-float32-columns-None`."""
    if not isinstance(case, tuple):
        return str(case)
    return "-".join(getattr(x, "__name__", str(x)) for x in case)


def _close(case, got, want, **tolerance):
    """`assert_trees_close`, the failing case named."""
    try:
        assert_trees_close(got, want, **tolerance)
    except AssertionError as error:
        msg = f"{_label(case)}: {error}"
        raise AssertionError(msg) from None


# ---------------------------------------------------------------------- values


# (kind, dtype, layout, block, n, d): every dtype once with the layouts and block
# shapes in turn, and BCOO for a vector and a block.
VALUE_CASES = [
    ("dense", jnp.float32, "columns", None, 5, 7),
    ("dense", jnp.float64, "rows", 3, 5, 7),
    ("dense", jnp.complex64, "columns", 3, 5, 7),
    ("dense", jnp.complex128, "rows", None, 5, 7),
    ("bcoo", jnp.float64, "columns", None, 7, 11),
    ("bcoo", jnp.complex64, "columns", 2, 7, 11),
]
DEPTHS_VALUES = (1, 2, 3, 4, 16, 17)


def test_values():
    """Doubling's Krylov matrix is a plain loop's, in its dtype: every dtype, layout
    and block shape, dense and BCOO, every d mod 4 and both sides of a power of two
    (d = 1 to 4, 16, 17). A complex matrix with a real `x0` gives the scan's complex
    result."""
    problems = []
    for kind, dtype, _, block, n, _ in VALUE_CASES:
        A, x0 = numpy_problem(dtype, block, n=n)
        params, build = numpy_operator(kind, A)
        problems.append((params, x0, build, dense_of_numpy(kind, A)))
    A, x0 = numpy_problem(jnp.float64)
    C, z0 = numpy_problem(jnp.complex64)

    @jax.jit
    def values(args, A, x0, C, z):
        cases = [
            krylovjax.krylov(build(p), x, d, layout=layout, method="doubling")
            for (p, x), (_, _, build, _), (_, _, layout, _, _, d) in zip(
                args, problems, VALUE_CASES, strict=True
            )
        ]
        depths = [krylovjax.krylov(A, x0, d, method="doubling") for d in DEPTHS_VALUES]
        promoted = [krylovjax.krylov(C, z, 6, method=m) for m in ("doubling", "scan")]
        return cases, depths, promoted

    cases, depths, (got, scan) = values(
        [(p, x) for p, x, _, _ in problems], A, x0, C, z0.real
    )
    for case, X, (_, x, _, dense) in zip(VALUE_CASES, cases, problems, strict=True):
        kind, dtype, layout, _, _, d = case
        want = krylov_numpy(dense, x, d, layout)
        assert X.dtype == dtype, _label(case)
        _close(case, X, want, **tol(dtype))
    for d, X in zip(DEPTHS_VALUES, depths, strict=True):
        _close(f"d={d}", X, krylov_numpy(A, x0, d), **tol(jnp.float64))
    assert got.dtype == jnp.complex64
    _close("complex A, real x0", got, scan, **tol(jnp.complex64))


# ------------------------------------------------------------------ gradients


# (method, adjoint, layout, d): every method and rule once, the layouts and depths in
# turn; doubling's reverse pass at n = 5 with one level (d = 2, the powers fit in
# memory) and with three (d = 5, where they do not).
EMPTY_CASES = [
    ("doubling", "custom_vjp", "columns", 2),
    ("doubling", "custom_vjp", "rows", 5),
    ("doubling", "autodiff", "rows", 5),
    ("scan", "custom_vjp", "columns", 5),
    ("scan", "custom_jvp", "rows", 2),
    ("scan", "autodiff", "columns", 5),
]


def test_empty_block():
    """A block of zero columns: an empty Krylov matrix and zero gradients, the same
    by both methods, for every case of `EMPTY_CASES`."""
    A, _ = numpy_problem(jnp.float64)
    x0 = np.zeros((N, 0))

    def outputs(A, x0, method, adjoint, layout, d):
        def f(A, x0):
            return krylovjax.krylov(
                A, x0, d, layout=layout, method=method, adjoint=adjoint
            )

        return f(A, x0), jax.grad(lambda A, x0: f(A, x0).sum(), (0, 1))(A, x0)

    results = jax.jit(lambda A, x0: [outputs(A, x0, *c) for c in EMPTY_CASES])(A, x0)
    for case, (out, (grad_A, grad_x0)) in zip(EMPTY_CASES, results, strict=True):
        _, _, layout, d = case
        name = _label(case)
        assert out.shape == ((N, d, 0) if layout == "columns" else (d, N, 0)), name
        assert grad_A.shape == (N, N), name
        assert not np.asarray(grad_A).any(), name
        assert grad_x0.shape == (N, 0), name


def _vjp_cases(cases, pairs):
    """For each `(kind, dtype, d, block, layout, n)` of `cases`, the VJPs of every
    `(method, adjoint)` of `pairs` at one random cotangent, all in one program."""
    problems = []
    for i, (kind, dtype, d, block, layout, n) in enumerate(cases):
        A, x0 = numpy_problem(dtype, block, n=n)
        params, build = numpy_operator(kind, A)

        def f(method, adjoint, build=build, d=d, layout=layout):
            def fn(p, x):
                return krylovjax.krylov(
                    build(p), x, d, layout=layout, method=method, adjoint=adjoint
                )

            return fn

        ct = numpy_like(i + 7, jax.eval_shape(f("scan", "autodiff"), params, x0))
        problems.append((f, (params, x0, ct)))

    @jax.jit
    def vjps(args):
        return [
            [jax.vjp(f(*pair), p, x)[1](ct) for pair in pairs]
            for (f, _), (p, x, ct) in zip(problems, args, strict=True)
        ]

    return vjps([args for _, args in problems])


# Every operator kind and every dtype once, vector and block in turn.
VJP_CASES = [
    ("dense", jnp.float32, 9, None, "columns", N),
    ("dense", jnp.complex128, 9, 3, "columns", N),
    ("bcoo", jnp.complex64, 9, 3, "columns", N),
    ("closure", jnp.float64, 9, 3, "columns", N),
    ("module", jnp.complex128, 9, None, "columns", N),
    ("method", jnp.float32, 9, 3, "columns", N),
]


def test_vjp_against_scan():
    """Doubling's custom VJP and autodiff through doubling equal autodiff through
    the scan, for every operator kind and dtype (`VJP_CASES`)."""
    pairs = [("doubling", "custom_vjp"), ("scan", "autodiff"), ("doubling", "autodiff")]
    results = _vjp_cases(VJP_CASES, pairs)
    for case, (custom, scan, autodiff) in zip(VJP_CASES, results, strict=True):
        _close((*case, "custom_vjp"), custom, scan, **tol(case[1]))
        _close((*case, "autodiff"), autodiff, scan, **tol(case[1]))


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


def test_vjp_both_reverse_schemes_every_depth():
    """Doubling's custom VJP equals autodiff through the scan for both schemes of
    its reverse pass at every d mod 4 (`REVERSE_CASES`: n, d, block, layout)."""
    cases = [
        ("dense", jnp.float64, d, block, layout, n)
        for n, d, block, layout in REVERSE_CASES
    ]
    pairs = [("doubling", "custom_vjp"), ("scan", "autodiff")]
    results = _vjp_cases(cases, pairs)
    for case, (custom, scan) in zip(REVERSE_CASES, results, strict=True):
        _close(case, custom, scan, **tol(jnp.float64))


def test_custom_rule_runs():
    # Doubling's own reverse pass sums in another order than JAX's differentiation
    # of the forward levels: close, but not bitwise equal.
    A, x0 = numpy_problem(jnp.float64, n=6)
    W = numpy_array(5, (6, 40), jnp.float64)

    def grad(adjoint):
        def loss(A, x0):
            X = krylovjax.krylov(A, x0, 40, method="doubling", adjoint=adjoint)
            return jnp.sum(X * W)

        return jax.grad(loss, (0, 1))(A, x0)

    custom, plain = jax.jit(lambda: (grad("custom_vjp"), grad("autodiff")))()
    assert_trees_close(custom, plain, **tol(jnp.float64))
    assert not all(np.array_equal(a, b) for a, b in zip(custom, plain, strict=True))


def _check_vjp_finite_differences(f, args, err_msg):
    """`jax.test_util.check_grads(f, args, order=1, modes=["rev"])`: the same random
    directions, step and tolerances, with `f` and its VJP evaluated by one jitted
    program (the finite differences call it at `args` moved along a direction:
    NumPy arrays of the same shapes, nothing compiled again)."""
    args = tuple(args)
    zero = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), jax.eval_shape(f, *args))

    @jax.jit
    def value_and_vjp(args, ct):
        out, vjp = jax.vjp(f, *args)
        return out, vjp(ct)

    def forward(*args):
        return value_and_vjp(args, zero)[0]

    def f_vjp(*args):
        return forward(*args), lambda ct: value_and_vjp(args, ct)[1]

    check_vjp(forward, f_vjp, args, err_msg=err_msg)


# (kind, block, adjoint, dtype, n, d, layout). First order: second derivatives of
# doubling's rule are checked against autodiff in
# test_transforms.py::test_krylov_transforms_dense (grad of grad) and
# test_transforms.py::test_krylov_forward_mode (jax.hessian).
FINITE_DIFFERENCE_CASES = [
    ("dense", 2, "custom_vjp", jnp.float64, 4, 6, "columns"),
    ("bcoo", None, "custom_vjp", jnp.float64, 4, 6, "columns"),
    ("bcoo", 2, "autodiff", jnp.float64, 4, 6, "columns"),
    ("dense", 2, None, jnp.complex128, 3, 5, "rows"),
]


@pytest.mark.parametrize(
    "kind, block, adjoint, dtype, n, d, layout", FINITE_DIFFERENCE_CASES
)
def test_grads_finite_differences(kind, block, adjoint, dtype, n, d, layout):
    A, x0 = numpy_problem(dtype, block, n=n)
    params, build = numpy_operator(kind, A)

    def f(p, x):
        return krylovjax.krylov(
            build(p), x, d, layout=layout, method="doubling", adjoint=adjoint
        )

    _check_vjp_finite_differences(f, (params, x0), "VJP")


# ----------------------------------------------------------------- transforms


def _weighted_loss(method, d=8):
    W = numpy_array(5, (N, d), jnp.float64)

    def loss(A, x):
        X = krylovjax.krylov(A, x, d, method=method)
        return scalar_loss(X, "weights_argument", W)

    return loss


def test_vmap_of_grad_over_x0_or_A():
    """vmap of doubling's gradient over the starting vectors alone and over the
    operators alone equals the scan's (over both: test_transforms.py)."""
    problems = [numpy_problem(jnp.float64, seed=s) for s in range(3)]
    As = np.stack([A for A, _ in problems])
    xs = np.stack([x for _, x in problems])
    in_axes = [(None, 0), (0, None)]

    @jax.jit
    def run(As, xs):
        out = []
        for axes in in_axes:
            args = (As[0] if axes[0] is None else As, xs[0] if axes[1] is None else xs)
            grads = [
                jax.vmap(jax.grad(_weighted_loss(m), (0, 1)), axes)(*args)
                for m in ("doubling", "scan")
            ]
            out.append(grads)
        return out

    for axes, (got, want) in zip(in_axes, run(As, xs), strict=True):
        _close(f"in_axes={axes}", got, want, **tol(jnp.float64))


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


MATERIALISED_SHAPES = [(5, 3), (2, 3, 2)]


def test_callable_is_materialised():
    """A callable's matrix acts on x0 flattened, so a map that mixes the columns of
    a block (or any axes) is doubled exactly as the scan iterates it: values and
    gradients, for a block and for three axes (a vector x0 with a callable is in
    test_vjp_against_scan)."""
    problems = []
    for i, shape in enumerate(MATERIALISED_SHAPES):
        A = numpy_array((3, i, 0), (shape[0], shape[0]), jnp.float64) / 3
        B = numpy_array((3, i, 1), shape[1:] * 2, jnp.float64) / 2
        x0 = numpy_array((3, i, 2), shape, jnp.float64)
        problems.append((A, B, x0))

    def loss(A, B, x0, method):
        axes = x0.ndim - 1

        def op(x):
            return jnp.tensordot(A, jnp.tensordot(x, B, axes) if axes else x, 1)

        return jnp.sum(jnp.sin(krylovjax.krylov(op, x0, 6, method=method)))

    value = jax.value_and_grad(loss, (0, 1, 2))
    results = jax.jit(
        lambda problems: [
            (value(*args, "doubling"), value(*args, "scan")) for args in problems
        ]
    )(problems)
    for shape, (got, want) in zip(MATERIALISED_SHAPES, results, strict=True):
        _close(f"x0 of shape {shape}", got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("d", [0, -2])
def test_bad_depth(d):
    A, x0 = numpy_problem(jnp.float32)
    with pytest.raises(ValueError, match=r"krylov\(d=\.\.\.\)"):
        krylovjax.krylov(A, x0, d, method="doubling")


def test_bad_method():
    A, x0 = numpy_problem(jnp.float32)
    with pytest.raises(ValueError, match=r"krylov\(method=\.\.\.\).*'doubling'"):
        unchecked(krylovjax.krylov)(A, x0, 4, method="doubled")


# ------------------------------------------------------------------------ auto

# `auto_method` reads only shapes and dtypes: arrays put on the device from NumPy
# (`jax.device_put` compiles nothing; `jnp.asarray`, which `auto_method` applies to a
# NumPy array, compiles a copy for each shape and dtype).


def _device(x):
    return jax.device_put(np.asarray(x))


DEPTHS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
AUTO_DTYPES = (jnp.float32, jnp.float64, jnp.complex64, jnp.complex128)


@pytest.mark.parametrize("dtype", AUTO_DTYPES)
@pytest.mark.parametrize("n", [2, 4, 16, 64, 256, 512])
def test_auto_method_is_monotone_in_depth(dtype, n):
    # Doubling pays off for long sequences: once auto picks it at some d, it picks
    # it at every larger d; and a long enough sequence of a small matrix gets it.
    A = _device(np.zeros((n, n), dtype))
    x0 = _device(np.ones(n, dtype))
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
    A, x0 = _device(np.zeros((1024, 1024), dtype)), _device(np.ones(1024, dtype))
    assert all(krylovjax.auto_method(A, x0, d) == "scan" for d in DEPTHS)


@pytest.mark.parametrize("n", [4, 16, 64, 256])
@pytest.mark.parametrize("block", [2, 8])
def test_auto_method_block_counts_at_least_as_long(n, block):
    # A block of b vectors makes each scan step a matrix product: doubling for a
    # vector implies doubling for the block at the same d.
    A, x0, X0 = (_device(np.zeros(s)) for s in [(n, n), (n,), (n, block)])
    for d in DEPTHS:
        if krylovjax.auto_method(A, x0, d) == "doubling":
            assert krylovjax.auto_method(A, X0, d) == "doubling"


@pytest.mark.parametrize("kind", ["bcoo", "callable"])
@pytest.mark.parametrize("d", [16, 1024, 8192])
def test_auto_method_sparse_and_callable_is_scan(kind, d):
    A = np.eye(4) / 2
    if kind == "bcoo":
        diagonal = np.stack([np.arange(4), np.arange(4)], axis=1).astype(np.int32)
        A = sparse.BCOO((_device(np.diag(A)), _device(diagonal)), shape=(4, 4))
    else:
        A = lambda x, A=A: A @ x  # noqa: E731
    assert krylovjax.auto_method(A, _device(np.ones(4)), d) == "scan"


def test_auto_method_checks_its_arguments():
    with pytest.raises(ValueError, match=r"`auto_method\(x0=...\)` must have first"):
        unchecked(krylovjax.auto_method)(np.eye(4), np.ones(3), 16)
    with pytest.raises(TypeError, match=r"`auto_method\(d=...\)`"):
        unchecked(krylovjax.auto_method)(np.eye(4), np.ones(4), 2.5)


def test_auto_runs_the_chosen_method():
    """auto gives exactly what the method it names gives, values and gradients, at
    a depth where it picks the scan (d = 16) and one where it picks doubling
    (d = 1024)."""
    A, x0 = numpy_problem(jnp.float32, n=4)
    depths = (16, 1024)
    chosen = [krylovjax.auto_method(A, x0, d) for d in depths]
    assert chosen == ["scan", "doubling"]

    def run(A, x0, method, d):
        def loss(A, x0):
            return krylovjax.krylov(A, x0, d, method=method).sum()

        return krylovjax.krylov(A, x0, d, method=method), jax.grad(loss, (0, 1))(A, x0)

    results = jax.jit(
        lambda A, x0: [
            (run(A, x0, "auto", d), run(A, x0, m, d))
            for d, m in zip(depths, chosen, strict=True)
        ]
    )(A, x0)
    for d, (auto, named) in zip(depths, results, strict=True):
        for a, b in zip(jax.tree.leaves(auto), jax.tree.leaves(named), strict=True):
            assert np.array_equal(a, b), f"d={d}"
