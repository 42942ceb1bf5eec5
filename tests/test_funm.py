"""`funm_action` and `trace_funm`: values against dense references, statistics of the
trace estimate, gradients against three oracles, operator kinds, transforms, errors.

The references are SciPy and NumPy on the dense matrix: `scipy.linalg.expm`,
`fractional_matrix_power`, `logm`, and $V f(\\Lambda) V^H$ from `numpy.linalg.eigh`.
The trace estimator is also written in NumPy with the same probes (the docstring says
how they are drawn from the key), and its gradient by the Daleckii--Krein formula.

Compiling is what these tests spend their time on, so every computation is jitted,
a test compiles one program with all its cases, and a test that checks several
things of one problem (values, derivatives by autodiff and by finite differences,
a second input of the same shapes) calls that program for each.
"""

import subprocess
import sys
from functools import partial

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.scipy.linalg
import numpy as np
import pytest
import scipy.linalg
from helpers import (
    Linear,
    check_finite_differences,
    full_operator,
    random_like,
    spd,
    unchecked,
    value_vjp_jvp,
)

import krylovjax

N = 10
expm = jax.scipy.linalg.expm


# ------------------------------------------------------------------- problems


def general(n=N, seed=2, dtype=np.float64):
    """A non-normal matrix of norm about 1."""
    rng = np.random.default_rng(seed)
    A = rng.normal(size=(n, n))
    if np.issubdtype(dtype, np.complexfloating):
        A = A + 1j * rng.normal(size=(n, n))
    return (A / np.sqrt(n) + np.triu(np.ones((n, n)), 1) / n).astype(dtype)


def vector(n=N, seed=1, dtype=np.float64):
    rng = np.random.default_rng(seed)
    b = rng.normal(size=n)
    if np.issubdtype(dtype, np.complexfloating):
        b = b + 1j * rng.normal(size=n)
    return b.astype(dtype)


def sym_funm(S, f):
    """f(S) for a Hermitian S by eigh, in NumPy."""
    w, V = np.linalg.eigh(S)
    return (V * f(w)) @ V.conj().T


def symmetrise(kind, params):
    """The parameters of `full_operator(kind, ...)` made symmetric. Finite differences
    perturb a matrix off the symmetric ones, which Lanczos does not represent, so
    the gradient checks differentiate through this, as a model that learns a
    symmetric matrix does."""
    if kind == "bcoo":
        n = round(np.sqrt(params.shape[0]))
        i, j = np.divmod(np.arange(n * n), n)
        return (params + params[j * n + i]) / 2
    if kind == "module":
        return Linear((params.weight + params.weight.T) / 2)
    return (params + params.T) / 2


def relative_error(x, y):
    return float(np.linalg.norm(np.asarray(x) - y) / np.linalg.norm(y))


def decreasing(errors):
    return all(e1 > e2 for e1, e2 in zip(errors, errors[1:], strict=False))


def cycle(n):
    """The adjacency matrix of the cycle graph C_n: bipartite for even n, so the
    Rayleigh quotient b^T A b of a vertex is 0. Eigenvalues 2 cos(2 pi k / n), most
    of them double, so the Krylov space of any b is invariant after about n / 2
    vectors."""
    C = np.roll(np.eye(n), 1, axis=0)
    return C + C.T


def resolvent(shift, H):
    """(shift I - H)^{-1}: a matrix function cheaper to compile than `expm`."""
    eye = jnp.eye(H.shape[0], dtype=H.dtype)
    return jnp.linalg.solve(shift.astype(H.dtype) * eye - H, eye)


SCALAR = {
    "exp": (lambda x: jnp.exp(-x), lambda w: np.exp(-w)),
    "inv_sqrt": (lambda x: x**-0.5, lambda w: w**-0.5),
    "log": (jnp.log, np.log),
}
DEPTHS = (2, 5, N)


# --------------------------------------------------------------------- values


def test_lanczos_matches_dense_references_and_converges():
    """exp(-S) b at every depth (the error falls), S^{-1/2} b and log(S) b at d = n,
    against SciPy; a complex Hermitian matrix, a complex-valued f (the propagator
    exp(-iS) b) and float32, in one program."""
    S, b = spd(), vector()
    S_c, b_c = spd(dtype=np.complex128), vector(dtype=np.complex128)

    def schroedinger(x):
        # exp(-i x), with the cast to complex explicit (strict promotion).
        return jnp.exp(-1j * x.astype(jnp.complex128))

    def action(f, S, b, d=N):
        return krylovjax.funm_action(f, S, b, d, method="lanczos")

    @jax.jit
    def run(S, b, S_c, b_c):
        return {
            "exp": [action(SCALAR["exp"][0], S, b, d) for d in DEPTHS],
            "inv_sqrt": [action(SCALAR["inv_sqrt"][0], S, b)],
            "log": [action(jnp.log, S, b)],
            "hermitian": action(lambda x: jnp.exp(-x), S_c, b_c),
            "propagator": action(schroedinger, S, b),
            "float32": action(jnp.log, S.astype(jnp.float32), b.astype(jnp.float32)),
        }

    results = run(*map(jnp.asarray, (S, b, S_c, b_c)))
    references = {
        "exp": scipy.linalg.expm(-S) @ b,
        "inv_sqrt": scipy.linalg.fractional_matrix_power(S, -0.5).real @ b,
        "log": scipy.linalg.logm(S).real @ b,
    }
    for name, (_, f_np) in SCALAR.items():
        np.testing.assert_allclose(sym_funm(S, f_np) @ b, references[name], rtol=1e-9)
        errors = [relative_error(y, references[name]) for y in results[name]]
        assert errors[-1] < 1e-12, (name, errors)
        assert decreasing(errors), (name, errors)
    hermitian, propagator = results["hermitian"], results["propagator"]
    assert hermitian.dtype == propagator.dtype == jnp.complex128
    np.testing.assert_allclose(hermitian, scipy.linalg.expm(-S_c) @ b_c, rtol=1e-11)
    np.testing.assert_allclose(propagator, scipy.linalg.expm(-1j * S) @ b, rtol=1e-11)
    y = results["float32"]
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, sym_funm(S, np.log) @ b, rtol=1e-4, atol=1e-5)


def test_arnoldi_matches_scipy_and_converges():
    """A non-normal matrix: (3 I - A)^{-1} b at every depth (the error falls), and
    exp(A) b by `jax.scipy.linalg.expm` in complex128 against SciPy, in one
    program (float64 `expm` is in test_closed_form_time_derivative)."""
    A, b = general(), vector()
    A_c, b_c = general(dtype=np.complex128), vector(dtype=np.complex128)

    @jax.jit
    def run(A, b, A_c, b_c):
        shifted = [
            krylovjax.funm_action(
                lambda H: resolvent(jnp.asarray(3.0), H), A, b, d, method="arnoldi"
            )
            for d in DEPTHS
        ]
        return shifted, krylovjax.funm_action(expm, A_c, b_c, N, method="arnoldi")

    shifted, y = run(*map(jnp.asarray, (A, b, A_c, b_c)))
    errors = [relative_error(y, np.linalg.solve(3 * np.eye(N) - A, b)) for y in shifted]
    assert errors[-1] < 1e-12, errors
    assert decreasing(errors), errors
    assert y.dtype == jnp.complex128
    assert relative_error(y, scipy.linalg.expm(A_c) @ b_c) < 1e-12


def test_operator_kinds_match_the_dense_references():
    """A BCOO matrix and an Equinox module with Lanczos, a closure with Arnoldi, and
    a closure (with `like=`, which a callable needs) in the trace estimate, at
    d = n against SciPy and the NumPy estimator with the same probes, in one
    program. (The decompositions take every kind the same way in both functions:
    test_decompositions.py.)"""
    S, A, b = spd(), general(), vector()
    key, m = jr.key(2), 4
    like = jax.ShapeDtypeStruct((N,), jnp.float64)
    uses = {
        "lanczos": (-S, ("bcoo", "module")),
        "arnoldi": (A, ("closure",)),
        "trace": (S, ("closure",)),
    }
    operators = {
        (use, kind): full_operator(kind, M)
        for use, (M, kinds) in uses.items()
        for kind in kinds
    }

    def compute(use, A):
        if use == "lanczos":
            return krylovjax.funm_action(jnp.exp, A, b, N, method="lanczos")
        if use == "arnoldi":
            return krylovjax.funm_action(
                lambda H: resolvent(jnp.asarray(3.0), H), A, b, N, method="arnoldi"
            )
        return krylovjax.trace_funm(jnp.log, A, key, N, num_probes=m, like=like)

    @jax.jit
    def run(params):
        return {
            key: compute(key[0], build(params[key]))
            for key, (_, build) in operators.items()
        }

    out = run({key: p for key, (p, _) in operators.items()})
    Z = probes(key, "rademacher", m, N)
    references = {
        "lanczos": scipy.linalg.expm(-S) @ b,
        "arnoldi": np.linalg.solve(3 * np.eye(N) - A, b),
        "trace": np.mean(np.einsum("mi,ij,mj->m", Z, sym_funm(S, np.log), Z)),
    }
    for (use, kind), y in out.items():
        if use == "trace":
            np.testing.assert_allclose(y, references[use], rtol=1e-11, err_msg=kind)
        else:
            assert relative_error(y, references[use]) < 1e-12, (use, kind)


def test_half_precision():
    """bfloat16 and float16. exp(A) b for bfloat16 A and b with spectrum in
    [10, 12], by both methods (JAX has no bfloat16 `eigh` or `expm`): bfloat16, and
    within one bfloat16 epsilon of exp(A) b, norm-wise (the exact value rounded to
    bfloat16 is within 0.15 of one). There e^lambda has the relative error of
    lambda's absolute one, so this needs the decomposition and the small matrix
    worked in float32: rounding T to bfloat16 (spacing 1/16 near 11) alone costs 1.5
    epsilons here. The trace estimate of log for float16 and bfloat16 matrices: the
    quadratures run in float32 and the estimate comes back in the matrix's dtype,
    within one epsilon of the same estimator in NumPy with the same probes. One
    program."""
    S, key, m = spd(8, low=10.0, high=12.0), jr.key(1), 4
    A = jnp.asarray(S, jnp.bfloat16)
    b = jnp.asarray(vector(8), jnp.bfloat16)
    dtypes = (jnp.float16, jnp.bfloat16)

    @jax.jit
    def run(A, b, mats):
        actions = (
            krylovjax.funm_action(jnp.exp, A, b, 8, method="lanczos"),
            krylovjax.funm_action(expm, A, b, 8, method="arnoldi"),
        )
        traces = [krylovjax.trace_funm(jnp.log, M, key, 8, num_probes=m) for M in mats]
        return actions, traces

    actions, traces = run(A, b, [jnp.asarray(S, dtype) for dtype in dtypes])
    expected = scipy.linalg.expm(np.asarray(A, np.float64)) @ np.asarray(b, np.float64)
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    for y in actions:
        assert y.dtype == jnp.bfloat16
        assert relative_error(np.asarray(y, np.float64), expected) < eps
    # A half-precision matrix's Rademacher probes are drawn as in 32-bit mode
    # (uniform numbers in float32; the docstring's note), here in 64-bit mode.
    with jax.enable_x64(False):
        Z = np.asarray(jr.rademacher(key, (m, 8), jnp.float32), np.float64)
    for dtype, estimate in zip(dtypes, traces, strict=True):
        M = sym_funm(np.asarray(jnp.asarray(S, dtype), np.float64), np.log)
        same_probes = np.mean(np.einsum("mi,ij,mj->m", Z, M, Z))
        assert estimate.dtype == dtype
        eps = float(jnp.finfo(dtype).eps)
        assert abs(float(estimate) - same_probes) < eps * abs(same_probes)


# ------------------------------------------------------------------ breakdowns


def test_breakdown_is_exact_with_finite_gradients():
    """Three distinct eigenvalues: the Krylov space is invariant after three steps,
    and the tridiagonal matrix of six steps has a repeated eigenvalue (the zero
    block after the breakdown), where JAX's own `eigh` rule divides by zero. The
    result is exact, and so is its derivative in `b` (the approximation equals
    f(S) b for every b near it), in reverse and forward mode; and the derivative
    in `S` of the quadratic form b^T log(S) b (symmetrised, Lanczos reading S as
    symmetric) is the Daleckii-Krein closed form."""
    rng = np.random.default_rng(3)
    Q, _ = np.linalg.qr(rng.normal(size=(8, 8)))
    S = (Q * np.array([1.0, 1, 1, 2, 2, 4, 4, 4])) @ Q.T
    S = (S + S.T) / 2
    b, c = vector(8), vector(8, seed=5)

    def loss(S, b):
        return krylovjax.funm_action(jnp.log, S, b, 6, method="lanczos") @ c

    def naive(diagonal, off_diagonal):
        # JAX's own `eigh` rule on the same tridiagonal matrix (with the logarithm
        # kept away from the zero block).
        T = jnp.diag(diagonal) + jnp.diag(off_diagonal, 1) + jnp.diag(off_diagonal, -1)
        lam, V = jnp.linalg.eigh(T)
        return V @ (jnp.log(jnp.where(lam > 0.5, lam, 1.0)) * V[0]) @ c[:6]

    @jax.jit
    def run(S, b):
        value = krylovjax.funm_action(jnp.log, S, b, 6, method="lanczos")
        g_S, g_b = jax.grad(loss, argnums=(0, 1))(S, b)
        _, tangent = jax.jvp(lambda b: loss(S, b), (b,), (c,))
        dec = krylovjax.lanczos(S, b, 6)
        naive_grads = jax.grad(naive, argnums=(0, 1))(dec.diagonal, dec.off_diagonal)
        g_form = jax.grad(
            lambda S: krylovjax.funm_action(jnp.log, S, b, 6, method="lanczos") @ b
        )(S)
        return value, g_S, g_b, tangent, naive_grads, g_form

    value, g_S, g_b, tangent, naive_grads, g_form = run(jnp.asarray(S), jnp.asarray(b))
    lam, V = np.linalg.eigh(S)
    gap = lam[:, None] - lam[None, :]
    same = np.abs(gap) < 1e-9
    log_gap = np.log(lam)[:, None] - np.log(lam)[None, :]
    divided = np.where(same, 1 / lam[:, None], log_gap / np.where(same, 1, gap))
    w = V.T @ np.asarray(b)
    want = V @ (divided * np.outer(w, w)) @ V.T
    np.testing.assert_allclose((g_form + g_form.T) / 2, want, rtol=1e-9, atol=1e-12)
    F = sym_funm(S, np.log)
    np.testing.assert_allclose(value, F @ b, rtol=1e-10)
    assert bool(jnp.isfinite(g_S).all())
    np.testing.assert_allclose(g_b, F.T @ c, rtol=1e-9)
    np.testing.assert_allclose(tangent, c @ F @ c, rtol=1e-9)
    # JAX's rule gives nan there, so the finite gradients above come from
    # funm_action's rule.
    assert not all(bool(jnp.isfinite(g).all()) for g in naive_grads)


def test_breakdown_where_f_is_infinite_at_the_rayleigh_quotient():
    """C6 from a vertex: the Krylov space is invariant after 4 vectors (the
    eigenvalues are +-1 and +-2), and what the small matrix holds beyond them is
    zero, as is the Rayleigh quotient b^T A b (the graph is bipartite), where 1/x
    is infinite; with Arnoldi the zero block makes H singular. f(A) b = A^{-1} b
    exactly, for every b, for a shift s that f closes over, and along A itself
    (A + sI and (1 + t) A have the same Krylov spaces), so the derivatives in b and
    s and along A are closed forms; the rest of the gradient in A is finite.
    Reverse and forward mode, both methods (Lanczos at d = 5, Arnoldi at d = 6), in
    one program; it is called again with a zero b, whose small matrix is all zero
    (f infinite at each of its eigenvalues): zeros, and finite derivatives."""
    A, b, s = jnp.asarray(cycle(6)), jnp.eye(6)[0], jnp.asarray(0.0)
    c, db = jnp.asarray(vector(6, seed=5)), jnp.asarray(vector(6, seed=6))

    def action(method, A, b, s):
        if method == "lanczos":
            return krylovjax.funm_action(lambda x: 1 / (x + s), A, b, 5, method=method)

        def inv(H):
            return jnp.linalg.inv(H + s * jnp.eye(H.shape[0], dtype=H.dtype))

        return krylovjax.funm_action(inv, A, b, 6, method=method)

    @jax.jit
    def run(A, b, s):
        out = {}
        for method in ("lanczos", "arnoldi"):
            value, pullback = jax.vjp(partial(action, method), A, b, s)
            tangents = (A, db, jnp.ones_like(s))
            _, tangent = jax.jvp(partial(action, method), (A, b, s), tangents)
            out[method] = (value, pullback(c), tangent)
        return out

    inverse = np.linalg.inv(np.asarray(A))
    y = inverse[:, 0]
    for value, (g_A, g_b, g_s), tangent in run(A, b, s).values():
        np.testing.assert_allclose(value, y, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(g_b, inverse @ c, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(g_s, -c @ inverse @ y, rtol=1e-12)
        assert bool(jnp.isfinite(g_A).all())
        np.testing.assert_allclose(np.sum(g_A * A), -c @ y, rtol=1e-12)
        np.testing.assert_allclose(
            tangent, -y + inverse @ db - inverse @ y, rtol=1e-12, atol=1e-14
        )
    for method, (value, grads, tangent) in run(A, jnp.zeros(6), s).items():
        np.testing.assert_array_equal(value, np.zeros(6), err_msg=method)
        leaves = jax.tree.leaves((grads, tangent))
        assert all(bool(jnp.isfinite(g).all()) for g in leaves), method


def test_trace_breakdown_where_f_is_infinite_at_the_rayleigh_quotient():
    """Two disjoint edges (eigenvalues +-1, both double): every probe's Krylov
    space is invariant after 2 vectors, and a Rademacher probe z with
    z0 z1 = -z2 z3 has Rayleigh quotient exactly 0, where 1/x is infinite. The
    estimate of tr A^{-1} at d = 4 equals the same estimator in NumPy, and its
    gradient is finite, with the closed form along A itself (the estimate is
    homogeneous of degree -1 in A)."""
    A, key, m = jnp.asarray(np.kron(np.eye(2), [[0.0, 1.0], [1.0, 0.0]])), jr.key(0), 8
    Z = probes(key, "rademacher", m, 4)
    assert np.any(np.einsum("mi,ij,mj->m", Z, np.asarray(A), Z) == 0)
    value, grad = jax.jit(
        jax.value_and_grad(
            lambda A: krylovjax.trace_funm(lambda x: 1 / x, A, key, 4, num_probes=m)
        )
    )(A)
    same_probes = np.mean(np.einsum("mi,ij,mj->m", Z, np.linalg.inv(A), Z))
    np.testing.assert_allclose(value, same_probes, rtol=1e-12, atol=1e-14)
    assert bool(jnp.isfinite(grad).all())
    np.testing.assert_allclose(np.sum(grad * A), -same_probes, rtol=1e-12)


# ------------------------------------------------------------------ gradients


def _tree_close(got, want, **tol):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, **tol)


def _differ(got, want):
    """Whether some array of `got` is not bitwise that of `want`."""
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    return any(not np.array_equal(a, b) for a, b in pairs)


def test_derivatives_match_autodiff_and_finite_differences():
    """With respect to the operator's arrays, `b`, and an array that `f` closes
    over: Lanczos on a BCOO matrix in float64, and Arnoldi on a complex callable.
    The decompositions' rules (the default) against JAX's own rules through them
    (`adjoint="autodiff"`) with a random cotangent, and against finite
    differences in forward and reverse mode, from one program."""
    n, d = 6, 4
    p_bcoo, build_bcoo = full_operator("bcoo", spd(n))
    p_closure, build_closure = full_operator("closure", general(n, dtype=np.complex128))
    b, b_c = jnp.asarray(vector(n)), jnp.asarray(vector(n, dtype=np.complex128))

    def call(adjoint):
        def f(p_bcoo, p_closure, b, b_c, t):
            lanczos = krylovjax.funm_action(
                lambda x: (t + x) ** -0.5,
                build_bcoo(symmetrise("bcoo", p_bcoo)),
                b,
                d,
                method="lanczos",
                adjoint=adjoint,
            )
            arnoldi = krylovjax.funm_action(
                lambda H: resolvent(3 + t, H),
                build_closure(p_closure),
                b_c,
                d,
                method="arnoldi",
                adjoint=adjoint,
            )
            return lanczos, arnoldi

        return f

    args = (p_bcoo, p_closure, b, b_c, jnp.asarray(0.8, jnp.float64))
    tangents = random_like(jr.key(3), args)
    cts = random_like(jr.key(4), jax.eval_shape(call("custom_jvp"), *args))

    @jax.jit
    def run(args, tangents, cts):
        custom = value_vjp_jvp(call("custom_jvp"), args, tangents, cts)
        out, pullback = jax.vjp(call("autodiff"), *args)
        return custom, (out, pullback(cts))

    (out, grads, _), (out_ad, grads_ad) = run(args, tangents, cts)
    _tree_close(out, out_ad, rtol=1e-12)
    _tree_close(grads, grads_ad, rtol=1e-8, atol=1e-10)
    # Close, not the same program: the custom rules ran.
    assert _differ(grads, grads_ad)
    check_finite_differences(call("custom_jvp"), lambda *a: run(*a)[0], args, rtol=1e-6)


def test_closed_form_time_derivative():
    """d/dt exp(tA) b = A exp(tA) b, through an `f` that closes over t: Arnoldi by
    `jax.scipy.linalg.expm` on a non-normal matrix, forward and reverse mode in one
    program; and the values against SciPy. (Lanczos's closed form, under `jit`
    with `vmap` and outside `jit`: test_vmap_under_jit and
    test_derivatives_reach_a_python_float_that_f_closes_over.)"""
    matrices = {"arnoldi": jnp.asarray(general())}
    b, c, t = jnp.asarray(vector()), jnp.asarray(vector(seed=4)), jnp.asarray(0.7)

    def y(method, t, b):
        A = matrices[method]
        return krylovjax.funm_action(lambda H: expm(t * H), A, b, N, method=method)

    @jax.jit
    def run(t, b):
        out = {}
        for method in matrices:
            f = partial(y, method, b=b)
            value, tangent = jax.jvp(f, (t,), (jnp.ones_like(t),))
            out[method] = (value, tangent, jax.grad(lambda t, f=f: f(t) @ c)(t))
        return out

    for method, (value, tangent, grad) in run(t, b).items():
        A_np = np.asarray(matrices[method])
        value_np = scipy.linalg.expm(0.7 * A_np) @ np.asarray(b)
        assert relative_error(value, value_np) < 1e-12, method
        expected = A_np @ value_np
        np.testing.assert_allclose(tangent, expected, rtol=1e-10, err_msg=method)
        np.testing.assert_allclose(grad, expected @ np.asarray(c), rtol=1e-10)


def test_depth_one_is_the_rayleigh_quotient():
    r"""At d = 1 both methods give $f(\rho)\, b$ with $\rho = b^\top A b / b^\top b$
    (with `tol` too, which then uses that depth), and the gradient of
    $c^\top y$ in $A$ is $f'(\rho)\, (c^\top b)\, b b^\top / b^\top b$: a closed
    form. Arnoldi on a non-normal matrix. d = 1 failed at trace time for Arnoldi
    and for Lanczos with `tol`."""
    matrices = {"lanczos": jnp.asarray(spd(N)), "arnoldi": jnp.asarray(general())}
    b, c = jnp.asarray(vector()), jnp.asarray(vector(seed=4))

    @jax.jit
    def run(matrices):
        out = {}
        for method, A in matrices.items():
            for tol in (None, 1e-8):

                def y(A, method=method, tol=tol):
                    y = krylovjax.funm_action(jnp.exp, A, b, 1, method=method, tol=tol)
                    return y if tol is None else y[0]

                out[method, tol is None] = (y(A), jax.grad(lambda A, y=y: y(A) @ c)(A))
        return out

    for (method, _), (value, grad) in run(matrices).items():
        A, b_np, c_np = (np.asarray(v) for v in (matrices[method], b, c))
        rho = b_np @ A @ b_np / (b_np @ b_np)
        np.testing.assert_allclose(value, np.exp(rho) * b_np, rtol=1e-13)
        want = np.exp(rho) * (c_np @ b_np) * np.outer(b_np, b_np) / (b_np @ b_np)
        np.testing.assert_allclose(grad, want, rtol=1e-12, atol=1e-14)


def test_vmap_under_jit():
    """A batch of times and vectors, and the gradient for each."""
    S = jnp.asarray(spd())
    bs = jnp.stack([jnp.asarray(vector(seed=s)) for s in range(3)])
    ts = jnp.asarray([0.5, 1.0, 2.0])

    def heat(t, b):
        return krylovjax.funm_action(
            lambda x: jnp.exp(-t * x), S, b, N, method="lanczos"
        )

    out, grads = jax.jit(
        jax.vmap(lambda t, b: (heat(t, b), jax.grad(lambda t: heat(t, b).sum())(t)))
    )(ts, bs)
    for t, b, y, g in zip(ts, bs, out, grads, strict=True):
        E = scipy.linalg.expm(-float(t) * np.asarray(S))
        np.testing.assert_allclose(y, E @ np.asarray(b), rtol=1e-10)
        np.testing.assert_allclose(
            g, -(np.asarray(S) @ E @ np.asarray(b)).sum(), rtol=1e-9
        )


def test_derivatives_reach_a_python_float_that_f_closes_over():
    """`grad` and `jvp` called with a Python float t that `f` closes over (traced as
    a scalar that is not an array, so not under `jit`): d/dt c^T exp(-tS) b =
    -c^T S exp(-tS) b."""
    S, b, c = jnp.asarray(spd()), jnp.asarray(vector()), vector(seed=4)

    def y(t):
        fn = lambda x: jnp.exp(-t * x)  # noqa: E731
        return krylovjax.funm_action(fn, S, b, N, method="lanczos") @ c

    S_np = np.asarray(S)
    expected = -c @ S_np @ scipy.linalg.expm(-0.7 * S_np) @ np.asarray(b)
    np.testing.assert_allclose(jax.grad(y)(0.7), expected, rtol=1e-10)
    np.testing.assert_allclose(jax.jvp(y, (0.7,), (1.0,))[1], expected, rtol=1e-10)


# -------------------------------------------------------------- trace estimate


def probes(key, sampler, m, n):
    """The probes `trace_funm` draws, as its docstring says."""
    if sampler == "rademacher":
        return np.asarray(jr.rademacher(key, (m, n), jnp.float64))
    z = np.asarray(jr.normal(key, (m, n), jnp.float64))
    if sampler == "sphere":
        z = z * np.sqrt(n) / np.linalg.norm(z, axis=1, keepdims=True)
    return z


def variance(M, sampler):
    """The variance of one probe's z^T M z for a real symmetric M (the docstring's
    formulas)."""
    n = M.shape[0]
    frobenius = np.sum(M**2)
    if sampler == "rademacher":
        return 2 * (frobenius - np.sum(np.diag(M) ** 2))
    if sampler == "normal":
        return 2 * frobenius
    return 2 * n / (n + 2) * (frobenius - np.trace(M) ** 2 / n)


SAMPLERS = ("rademacher", "normal", "sphere")


def test_trace_matches_numpy_estimator_exact_trace_and_quadrature():
    """Each sampler's estimate of tr log(S) against the same estimator in NumPy and
    the exact trace; the quadrature error of each probe falling with d; and a
    diagonal matrix, whose estimate with Rademacher probes is exact. One program,
    called again for the diagonal matrix."""
    S, key, m = spd(low=0.1, high=10.0), jr.key(11), 200

    @jax.jit
    def run(S):
        estimates = {
            sampler: krylovjax.trace_funm(
                jnp.log, S, key, N, num_probes=m, sampler=sampler
            )
            for sampler in SAMPLERS
        }
        # Rademacher probes at fewer steps; at d = n the estimate above.
        quadrature = [
            krylovjax.trace_funm(jnp.log, S, key, d, num_probes=m) for d in (1, 3)
        ]
        return estimates, [*quadrature, estimates["rademacher"]]

    estimates, quadrature = run(jnp.asarray(S))
    M = sym_funm(S, np.log)
    for sampler, estimate in estimates.items():
        # The same probes in NumPy, with the exact f(S): equal at d = n.
        Z = probes(key, sampler, m, N)
        same_probes = np.mean(np.einsum("mi,ij,mj->m", Z, M, Z))
        np.testing.assert_allclose(estimate, same_probes, rtol=1e-11)
        # The exact trace is within four standard errors (a fixed seed: no flakes;
        # for a random seed this would fail about once in 16 000 runs).
        standard_error = np.sqrt(variance(M, sampler) / m)
        assert abs(float(estimate) - np.trace(M)) < 4 * standard_error, sampler
        if sampler == "rademacher":
            # Gauss quadrature: each probe's error falls quickly as d grows.
            errors = [abs(float(e) - same_probes) for e in quadrature]
            assert errors[-1] < 1e-10 * abs(same_probes), errors
            assert decreasing(errors), errors
    w = jnp.linspace(1.0, 5.0, N)
    estimate = run(jnp.diag(w))[0]["rademacher"]
    np.testing.assert_allclose(estimate, np.sum(np.log(np.asarray(w))), rtol=1e-12)


def test_trace_derivatives_closed_forms_fresh_keys_and_complex_matrices():
    """The log-det estimate of an Equinox module operator, log(x + t) with f closing
    over t, at d = n (each probe's quadrature exact), from one program (the key an
    argument):

    - its derivatives against JAX's own rules (`adjoint="autodiff"`) and against
      finite differences in forward and reverse mode, at t = 0.3;
    - at t = 0, the gradient is the Daleckii--Krein gradient for the drawn probes,
      which is S^{-1} when their mean outer product is the identity; with many
      probes it is within five standard errors of S^{-1}; forward mode gives the
      matching directional derivative;
    - a fresh key per call, as in a training step, gives a fresh estimate with
      finite gradients;
    - a complex Hermitian matrix gives a real estimate, that of the NumPy
      estimator with the same probes."""
    kind, n, m, key = "module", 6, 2000, jr.key(5)
    S = spd(n=n)
    params, build = full_operator(kind, S)
    S_c, m_c = spd(n=n, dtype=np.complex128), 50

    def estimate(adjoint, key):
        def f(params, t):
            A = build(symmetrise(kind, params))
            return krylovjax.trace_funm(
                lambda x: jnp.log(x + t),
                A,
                key,
                n,
                num_probes=m,
                like=jnp.zeros(n),
                adjoint=adjoint,
            )

        return f

    args = (params, jnp.asarray(0.3, jnp.float64))
    tangents = random_like(jr.key(3), args)
    ct = jnp.asarray(0.7, jnp.float64)

    @jax.jit
    def run(args, tangents, ct, key):
        _, pullback = jax.vjp(estimate("autodiff", key), *args)
        hermitian = krylovjax.trace_funm(jnp.log, S_c, key, n, num_probes=m_c)
        custom = value_vjp_jvp(estimate("custom_jvp", key), args, tangents, ct)
        return custom, pullback(ct), hermitian

    (value, grads, _), grads_ad, hermitian = run(args, tangents, ct, key)
    _tree_close(grads, grads_ad, rtol=1e-8, atol=1e-10)
    assert _differ(grads, grads_ad)

    def derivatives(args, tangents, ct):
        return run(args, tangents, ct, key)[0]

    check_finite_differences(estimate("custom_jvp", key), derivatives, args, rtol=1e-6)

    # Closed forms at t = 0 (the tangent E symmetric: the operator is symmetrised).
    E = spd(n=n, seed=8)
    zero, one = jnp.zeros((), jnp.float64), jnp.ones((), jnp.float64)
    (_, (g, _), tangent), _, _ = run(
        (params, zero), (Linear(jnp.asarray(E)), zero), one, key
    )
    Z = probes(key, "rademacher", m, n)
    expected = daleckii_krein(S, np.log, lambda w: 1 / w, Z.T @ Z / m)
    np.testing.assert_allclose(g.weight, expected, rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(tangent, np.sum(expected * E), rtol=1e-9)
    inverse = np.linalg.inv(S)
    np.testing.assert_allclose(
        daleckii_krein(S, np.log, lambda w: 1 / w, np.eye(n)), inverse, rtol=1e-10
    )
    per_probe = np.stack(
        [daleckii_krein(S, np.log, lambda w: 1 / w, np.outer(z, z)) for z in Z]
    )
    standard_error = per_probe.std(axis=0) / np.sqrt(m)
    assert np.all(np.abs(np.asarray(g.weight) - inverse) < 5 * standard_error + 1e-12)

    # Fresh keys.
    (v1, g1, _), _, _ = run(args, tangents, ct, jr.key(0))
    (v2, g2, _), _, _ = run(args, tangents, ct, jr.key(1))
    assert len({float(value), float(v1), float(v2)}) == 3
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves((g1, g2)))

    # A complex Hermitian matrix.
    assert hermitian.dtype == jnp.float64
    Z = probes(key, "rademacher", m_c, n)
    same_probes = np.mean(np.einsum("mi,ij,mj->m", Z, sym_funm(S_c, np.log), Z)).real
    np.testing.assert_allclose(hermitian, same_probes, rtol=1e-10)


def daleckii_krein(S, f, df, W):
    """The gradient of <W, f(S)> with respect to a symmetric S (distinct
    eigenvalues)."""
    w, V = np.linalg.eigh(S)
    gap = w[:, None] - w[None, :]
    same = np.eye(len(w), dtype=bool)
    F = np.where(same, df(w)[:, None], (f(w)[:, None] - f(w)[None, :]) / (gap + same))
    return V @ (F * (V.T @ W @ V)) @ V.T


def test_derivatives_with_small_eigenvalues_next_to_a_large_one():
    """Eigenvalues 1e-3 and 5e-2 beside 1e4. The logarithm changes fast between the
    two small ones, so their divided difference must be the quotient, not the mean
    of f' that serves eigenvalues too close to tell apart (close for the pair's own
    size, not the spectrum's: with the spectrum's, the derivative was 5x too
    large). At d = n the result is log(S) b exactly, and the log-det estimate is
    exact for its probes: both derivatives are the Daleckii--Krein ones."""
    rng = np.random.default_rng(7)
    Q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
    S = (Q * np.array([1e-3, 5e-2, 1e4])) @ Q.T
    S = (S + S.T) / 2
    b, c, E = vector(3), vector(3, seed=5), jnp.asarray(spd(n=3, seed=8))
    key, m = jr.key(2), 4

    def action(S):
        y = krylovjax.funm_action(
            jnp.log, (S + S.T) / 2, jnp.asarray(b), 3, method="lanczos"
        )
        return y @ c

    def logdet(S):
        return krylovjax.trace_funm(jnp.log, (S + S.T) / 2, key, 3, num_probes=m)

    grad, tangent, grad_trace = jax.jit(
        lambda S: (
            jax.grad(action)(S),
            jax.jvp(action, (S,), (E,))[1],
            jax.grad(logdet)(S),
        )
    )(jnp.asarray(S))
    W = np.outer(c, b)
    expected = daleckii_krein(S, np.log, lambda w: 1 / w, (W + W.T) / 2)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(grad, expected, rtol=1e-7, atol=1e-9 * scale)
    np.testing.assert_allclose(tangent, np.sum(expected * np.asarray(E)), rtol=1e-7)
    Z = probes(key, "rademacher", m, 3)
    expected = daleckii_krein(S, np.log, lambda w: 1 / w, Z.T @ Z / m)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(grad_trace, expected, rtol=1e-7, atol=1e-9 * scale)


def _step(g):
    """tanh of width g / 20 centred between 1 and 1 + g, its NumPy twin and slope."""

    def slope(w):
        t = np.exp(-2 * np.abs(w - (1 + g / 2)) / (g / 20))
        return 4 * t / (1 + t) ** 2 / (g / 20)

    return (
        lambda x: jnp.tanh((x - (1 + g / 2)) / (g / 20)),
        lambda w: np.tanh((w - (1 + g / 2)) / (g / 20)),
        slope,
    )


_OSCILLATION = (
    lambda x: jnp.exp(-1000j * x.astype(jnp.complex64)),
    lambda w: np.exp(-1000j * w),
    lambda w: -1000j * np.exp(-1000j * w),
)


_OSCILLATION = (
    lambda x: jnp.exp(-1000j * x.astype(jnp.complex64)),
    lambda w: np.exp(-1000j * w),
    lambda w: -1000j * np.exp(-1000j * w),
)

# (dtype, gap g, (f, its NumPy twin, f'), rtol)
FAST_CASES = {
    "float32-step": (np.float32, 2e-3, _step(2e-3), 2e-3),
    "float64-step": (np.float64, 2e-6, _step(2e-6), 1e-8),
    "complex64-oscillation": (np.float32, 2e-3, _OSCILLATION, 2e-3),
}


def test_derivatives_where_f_changes_fast_between_close_eigenvalues():
    """Eigenvalues 1, 1 + g and 3, and f stepping or oscillating between the two
    close ones. Their divided difference is the quotient (f_i - f_j) / g, well
    resolved here, not the mean of f' (about 0 for the step, whose f' is the same
    at both ends). The directional derivative of c^T f(S) b along a symmetric E,
    at d = n, against the Daleckii--Krein formula in float64 NumPy (which agrees
    with mpmath at 60 digits to 1e-10), to the dtype's accuracy: in float32 the
    result moves by about eps ||S|| / g relative (2e-4) as the eigenvalues and
    eigenvectors of the close pair do, and JAX's own `eigh` rule errs as much.
    Every case in one program."""
    problems = {}
    for name, (dtype, g, _, _) in FAST_CASES.items():
        rng = np.random.default_rng(0)
        Q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
        S = (Q * np.array([1.0, 1.0 + g, 3.0])) @ Q.T
        E = rng.normal(size=(3, 3))
        problems[name] = tuple(
            np.asarray(x, dtype)
            for x in ((S + S.T) / 2, E + E.T, vector(3), vector(3, seed=5))
        )

    def y(f, S, b, c):
        out = krylovjax.funm_action(f, S, b, 3, method="lanczos")
        return out @ c.astype(out.dtype)

    @jax.jit
    def run(problems):
        out = {}
        for name, (S, E, b, c) in problems.items():
            f = partial(y, FAST_CASES[name][2][0], b=b, c=c)
            out[name] = jax.jvp(f, (S,), (E,))[1]
        return out

    for name, tangent in run(problems).items():
        _, _, (_, f_np, df_np), rtol = FAST_CASES[name]
        S, E, b, c = problems[name]
        W = np.outer(c, b).astype(np.float64)
        expected = np.sum(daleckii_krein(S.astype(np.float64), f_np, df_np, W) * E)
        np.testing.assert_allclose(complex(tangent), expected, rtol=rtol, err_msg=name)


# --------------------------------------------------------------------- errors


def _traced(call):
    """`call`, made under `jax.eval_shape`: its errors are raised while tracing,
    and nothing is compiled or run."""

    def traced(*args, **kwargs):
        return jax.eval_shape(lambda: call(*args, **kwargs))

    return traced


A_ERR, B_ERR = jnp.eye(3) * 2.0, jnp.ones(3)


def test_chebyshev_expansion_matches_scipy_and_its_derivatives():
    """`method="chebyshev"`: exp(-t S) b at every depth (the error falls, to 1e-12
    at d = 20) against SciPy, on an interval wider than the spectrum; at d = 6
    the derivatives in S, b, the time t that f closes over and the interval's
    ends, by the recurrence's rule against plain autodiff through the same
    recurrence, and against float64 finite differences, from one program."""
    S, b = spd(), vector()
    interval = (0.3, 4.5)  # the spectrum is [0.5, 4]

    def action(S, b, t, lo, hi, d, adjoint="custom_jvp"):
        return krylovjax.funm_action(
            lambda x: jnp.exp(-t * x),
            S,
            b,
            d,
            method="chebyshev",
            interval=(lo, hi),
            adjoint=adjoint,
        )

    def loss(adjoint):
        return lambda S, b, t, lo, hi: jnp.sum(
            jnp.sin(action(S, b, t, lo, hi, 6, adjoint))
        )

    @jax.jit
    def run(args, tangents, cotangent):
        values = [action(*args, d) for d in (4, 8, 12, 20)]
        out = {}
        for adjoint in ("custom_jvp", "autodiff"):
            value, vjp = jax.vjp(loss(adjoint), *args)
            out[adjoint] = (
                value,
                vjp(cotangent),
                jax.jvp(loss(adjoint), args, tangents)[1],
            )
        return values, out

    args = tuple(jnp.asarray(v, jnp.float64) for v in (S, b, 0.7, *interval))
    tangents = random_like(jr.key(4), args)
    values, out = run(args, tangents, jnp.ones((), jnp.float64))
    want = scipy.linalg.expm(-0.7 * S) @ b
    errors = [relative_error(y, want) for y in values]
    assert errors[-1] < 1e-12, errors
    assert decreasing(errors), errors
    for got, want in zip(
        jax.tree.leaves(out["custom_jvp"]),
        jax.tree.leaves(out["autodiff"]),
        strict=True,
    ):
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-13)
    grad_hi = out["custom_jvp"][1][4]
    assert abs(float(grad_hi)) > 1e-6  # at d = 6 the interval matters

    check_finite_differences(
        loss("custom_jvp"), lambda *a: run(*a)[1]["custom_jvp"], args, rtol=1e-6
    )


def test_funm_action_errors():
    funm = _traced(krylovjax.funm_action)
    unchecked_funm = _traced(unchecked(krylovjax.funm_action))
    with pytest.raises(ValueError, match=r"`funm_action\(method=...\)` must be one of"):
        unchecked_funm(jnp.exp, A_ERR, B_ERR, 2, method="eig")
    with pytest.raises(TypeError, match="method"):
        unchecked_funm(jnp.exp, A_ERR, B_ERR, 2)
    with pytest.raises(TypeError, match=r"`funm_action\(f=...\)` must be a callable"):
        unchecked_funm("exp", A_ERR, B_ERR, 2, method="lanczos")
    with pytest.raises(ValueError, match=r"`funm_action\(d=...\)` must be an int >= 1"):
        funm(jnp.exp, A_ERR, B_ERR, 0, method="lanczos")
    with pytest.raises(ValueError, match=r"`funm_action\(d=...\)` must be at most n"):
        funm(jnp.exp, A_ERR, B_ERR, 4, method="lanczos")
    with pytest.raises(TypeError, match=r"`funm_action\(d=...\)` must be a Python int"):
        unchecked_funm(jnp.exp, A_ERR, B_ERR, 2.0, method="lanczos")
    with pytest.raises(ValueError, match=r"`funm_action\(b=...\)` must be a vector"):
        unchecked_funm(jnp.exp, A_ERR, jnp.ones((3, 2, 1)), 2, method="lanczos")
    with pytest.raises(TypeError, match=r"`funm_action\(b=...\)` must have a floating"):
        unchecked_funm(jnp.exp, A_ERR, jnp.ones(3, int), 2, method="lanczos")
    with pytest.raises(ValueError, match=r"`funm_action\(A=...\)` must be a square"):
        unchecked_funm(jnp.exp, jnp.ones((3, 2)), B_ERR, 2, method="lanczos")
    # Errors about the vector name it `b`, the argument of `funm_action`.
    with pytest.raises(
        ValueError, match=r"`funm_action\(b=...\)` must have first axis of length 3"
    ):
        unchecked_funm(jnp.exp, A_ERR, jnp.ones(4), 2, method="lanczos")
    with pytest.raises(ValueError, match=r"the same shape as `b`, \(3,\)"):
        funm(jnp.exp, lambda v: v[:2], B_ERR, 2, method="lanczos")
    with pytest.raises(TypeError, match=r"`funm_action\(reorthogonalize=...\)`"):
        unchecked_funm(
            jnp.exp, A_ERR, B_ERR, 2, method="lanczos", reorthogonalize="yes"
        )
    with pytest.raises(ValueError, match=r"`funm_action\(adjoint=...\)` must be one"):
        unchecked_funm(jnp.exp, A_ERR, B_ERR, 2, method="lanczos", adjoint="vjp")
    # A matrix function where a scalar one belongs, and the other way round.
    with pytest.raises(ValueError, match=r"`funm_action\(f=...\)` must map the \(2,\)"):
        funm(jnp.sum, A_ERR, B_ERR, 2, method="lanczos")
    with pytest.raises(
        ValueError, match=r"`funm_action\(f=...\)` must map the \(2, 2\)"
    ):
        funm(jnp.diag, A_ERR, B_ERR, 2, method="arnoldi")
    with pytest.raises(TypeError, match=r"`funm_action\(f=...\)` must map .* floating"):
        funm(lambda x: (x > 0).astype(jnp.int32), A_ERR, B_ERR, 2, method="lanczos")
    # A matrix function where a scalar one belongs fails inside `f`: the error names
    # `f` and the method that takes a matrix function.
    with pytest.raises(
        ValueError,
        match=r"`funm_action\(f=...\)` must be a scalar function, applied "
        r"elementwise to the \(3,\) eigenvalues .* Expected A to be a \(batched\) "
        r"square matrix.* use `method=\"arnoldi\"`",
    ):
        funm(expm, A_ERR, B_ERR, 3, method="lanczos")
    # The interval: required by method="chebyshev", and by no other.
    with pytest.raises(ValueError, match=r"`funm_action\(interval=...\)` is required"):
        funm(jnp.exp, A_ERR, B_ERR, 3, method="chebyshev")
    with pytest.raises(ValueError, match=r"`funm_action\(interval=...\)` is required"):
        funm(jnp.exp, A_ERR, B_ERR, 3, method="lanczos", interval=(0.0, 1.0))
    with pytest.raises(
        TypeError, match=r"`funm_action\(interval=...\)` must be a pair"
    ):
        unchecked_funm(jnp.exp, A_ERR, B_ERR, 3, method="chebyshev", interval=1.0)
    with pytest.raises(ValueError, match=r"`funm_action\(f=...\)` must be a scalar"):
        funm(jnp.sum, A_ERR, B_ERR, 3, method="chebyshev", interval=(0.0, 1.0))


def test_trace_funm_errors():
    key, trace = jr.key(0), _traced(krylovjax.trace_funm)
    unchecked_trace = _traced(unchecked(krylovjax.trace_funm))
    with pytest.raises(TypeError, match=r"`trace_funm\(like=...\)` is required"):
        trace(jnp.log, lambda x: 2 * x, key, 2, num_probes=2)
    with pytest.raises(ValueError, match=r"`trace_funm\(like=...\)` must have shape"):
        unchecked_trace(
            jnp.log, lambda x: 2 * x, key, 2, num_probes=2, like=jnp.ones((3, 2))
        )
    with pytest.raises(
        ValueError, match=r"`trace_funm\(like=...\)` must have shape \(3"
    ):
        unchecked_trace(jnp.log, A_ERR, key, 2, num_probes=2, like=jnp.ones(4))
    with pytest.raises(ValueError, match=r"`trace_funm\(sampler=...\)` must be one of"):
        unchecked_trace(jnp.log, A_ERR, key, 2, num_probes=2, sampler="gauss")
    with pytest.raises(ValueError, match=r"`trace_funm\(num_probes=...\)` must be an"):
        trace(jnp.log, A_ERR, key, 2, num_probes=0)
    with pytest.raises(
        ValueError, match=r"`trace_funm\(d=...\)` must be at most n = 3, the size of"
    ):
        trace(jnp.log, A_ERR, key, 4, num_probes=2)
    with pytest.raises(ValueError, match=r"the same shape as `like`, \(3,\)"):
        trace(jnp.log, lambda v: v[:2], key, 2, num_probes=2, like=jnp.ones(3))
    with pytest.raises(
        TypeError, match=r"`trace_funm\(A=...\)` must be a square array, .* type list"
    ):
        unchecked_trace(jnp.log, [[1.0, 0.0], [0.0, 1.0]], key, 2, num_probes=2)
    with pytest.raises(
        TypeError, match=r"`trace_funm\(key=...\)` must be one JAX PRNG"
    ):
        unchecked_trace(jnp.log, A_ERR, 0, 2, num_probes=2)
    with pytest.raises(TypeError, match=r"`trace_funm\(A=...\)` must have a floating"):
        unchecked_trace(jnp.log, jnp.eye(3, dtype=int), key, 2, num_probes=2)
    with pytest.raises(ValueError, match=r"`trace_funm\(A=...\)` must be a square"):
        unchecked_trace(jnp.log, jnp.ones((3, 2)), key, 2, num_probes=2)
    with pytest.raises(TypeError, match=r"`trace_funm\(f=...\)` must be a callable"):
        unchecked_trace(None, A_ERR, key, 2, num_probes=2)
    with pytest.raises(ValueError, match=r"`trace_funm\(f=...\)` must map the \(2,\)"):
        trace(jnp.sum, A_ERR, key, 2, num_probes=2)
    with pytest.raises(
        ValueError, match=r"`trace_funm\(f=...\)` must be a scalar function"
    ):
        trace(expm, A_ERR, key, 2, num_probes=2)
    # The m bases are one batch: too many probes name `num_probes`, before XLA's
    # allocator would fail.
    with pytest.raises(
        ValueError,
        match=r"`trace_funm\(num_probes=...\)` is too large: the batch of "
        r"1099511627776 Lanczos bases.*in batches with `probes_per_batch`",
    ):
        trace(jnp.log, A_ERR, key, 2, num_probes=2**40)
    # In batches, the batch's bases: too large a batch names `probes_per_batch`.
    with pytest.raises(
        ValueError,
        match=r"`trace_funm\(probes_per_batch=...\)` is too large: the batch of "
        r"549755813888 Lanczos bases",
    ):
        trace(jnp.log, A_ERR, key, 2, num_probes=2**40, probes_per_batch=2**39)


_CONCURRENT_EIGH_SCRIPT = """
import jax, jax.numpy as jnp, jax.random as jr, numpy as np
import krylovjax
jax.config.update("jax_enable_x64", True)
Q = np.linalg.qr(np.random.default_rng(0).standard_normal((6, 6)))[0]
S = jnp.asarray(Q @ np.diag(np.arange(1.0, 7.0)) @ Q.T)

def logdet(S):
    return krylovjax.trace_funm(jnp.log, S, jr.key(5), 6, num_probes=200)

f = jax.jit(lambda S: (jax.grad(logdet)(S), jax.jvp(logdet, (S,), (S,))[1]))
for _ in range(100):
    jax.block_until_ready(f(S))
print("done")
"""


def test_trace_estimate_and_its_derivatives_in_one_program_do_not_hang():
    # A value and two derivatives of a trace estimate in one jitted program run
    # several batches of small eigendecompositions at once. jaxlib's batched CPU
    # `eigh` waits, on its own thread pool, for the parts it gave that pool, and two
    # at once hung on two cores: with 200 probes at the first call, with 2000
    # within 50. In a subprocess, with a timeout.
    result = subprocess.run(
        [sys.executable, "-c", _CONCURRENT_EIGH_SCRIPT],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("done")
