"""`krylov` and `iterate` under jit, vmap, grad, checkpoint and forward mode."""

import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from helpers import (
    KINDS,
    METHODS,
    MLP,
    as_mv,
    assert_trees_close,
    grid,
    iterate_scan_reference,
    krylov_scan_reference,
    make_operator,
    random_array,
    random_matrix,
    tol,
)

import krylovjax

N, D, BATCH = 4, 4, 3
TOL = tol(jnp.float64)
FORWARD_MODE_ERROR = "can't apply forward-mode autodiff"


def _stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _params(kind, seed=0):
    """Operator parameters for one problem and for a batch of BATCH problems."""
    keys = jr.split(jr.key(seed), BATCH + 1)
    ops = [make_operator(kind, random_matrix(k, N, jnp.float64)) for k in keys]
    build = ops[0][1]
    return ops[0][0], _stack([p for p, _ in ops[1:]]), build


def _x0(seed=1):
    x0s = random_array(jr.key(seed), (BATCH + 1, N), jnp.float64)
    return x0s[0], x0s[1:]


CT = random_array(jr.key(9), (N, D), jnp.float64)


def _loss(f):
    # Nonlinear in the output, so that second derivatives are not trivially zero.
    return lambda p, x: jnp.sum(CT * f(p, x) ** 2)


TRANSFORMS = {
    "jit": lambda f, p, ps, x, xs: jax.jit(f)(p, x),
    "vmap_x0": lambda f, p, ps, x, xs: jax.vmap(f, (None, 0))(p, xs),
    "vmap_A": lambda f, p, ps, x, xs: jax.vmap(f, (0, None))(ps, x),
    "vmap_both": lambda f, p, ps, x, xs: jax.vmap(f)(ps, xs),
    "grad": lambda f, p, ps, x, xs: jax.grad(_loss(f), (0, 1))(p, x),
    "vmap_grad": lambda f, p, ps, x, xs: jax.vmap(jax.grad(_loss(f), (0, 1)))(ps, xs),
    "grad_grad": lambda f, p, ps, x, xs: jax.grad(
        lambda p, x: jnp.sum(jnp.sin(jax.grad(_loss(f), 1)(p, x))), (0, 1)
    )(p, x),
    "checkpoint": lambda f, p, ps, x, xs: jax.grad(_loss(jax.checkpoint(f)), (0, 1))(
        p, x
    ),
}


def _krylov_fns(build, method, adjoint="custom_vjp"):
    def lib(p, x):
        return krylovjax.krylov(build(p), x, D, adjoint=adjoint, method=method)

    def ref(p, x):
        return krylov_scan_reference(as_mv(build(p)), x, D)

    return lib, ref


def _check(transform, kind, method, adjoint):
    p, ps, build = _params(kind)
    x, xs = _x0()
    lib, ref = _krylov_fns(build, method, adjoint)
    apply = jax.jit(TRANSFORMS[transform], static_argnums=0)
    assert_trees_close(apply(lib, p, ps, x, xs), apply(ref, p, ps, x, xs), **TOL)


@grid(method=METHODS, adjoint=("custom_vjp", "custom_jvp"))
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_krylov_transforms_dense(method, adjoint, transform):
    _check(transform, "dense", method, adjoint)


@grid(method=METHODS, kind=["bcoo", "closure", "module", "method"])
@pytest.mark.parametrize("transform", ["vmap_both", "grad_grad"])
def test_krylov_transforms_operator_kinds(method, kind, transform):
    _check(transform, kind, method, "custom_vjp")


@pytest.mark.parametrize("kind", ["bcoo", "closure", "module", "method"])
def test_krylov_grad_grad_custom_jvp_operator_kinds(kind):
    # grad_grad runs the JVP rule, its transposition and the JVP of that; vmap of
    # the custom_jvp forward pass is the plain scan's and is covered on "dense".
    _check("grad_grad", kind, "scan", "custom_jvp")


@pytest.mark.parametrize("method", METHODS)
def test_krylov_jit_with_static_depth(method):
    p, _, _ = _params("dense")
    x, _ = _x0()
    f = jax.jit(krylovjax.krylov, static_argnums=2, static_argnames="method")
    assert_trees_close(f(p, x, D, method=method), krylov_scan_reference(as_mv(p), x, D))
    assert f(p, x, 2, method=method).shape == (N, 2)


# ----------------------------------------------------------------- forward mode

FORWARD = {
    "jvp": lambda f, p, x: jax.jvp(f, (p, x), (jnp.ones_like(p), jnp.ones_like(x))),
    "jacfwd": lambda f, p, x: jax.jacfwd(f, (0, 1))(p, x),
    "hessian": lambda f, p, x: jax.hessian(_loss(f), (0, 1))(p, x),
}


@grid(method=METHODS, adjoint=("custom_jvp", "autodiff"))
@pytest.mark.parametrize("mode", list(FORWARD))
def test_krylov_forward_mode(method, adjoint, mode):
    p, _, build = _params("dense")
    x, _ = _x0()
    lib, ref = _krylov_fns(build, method, adjoint)
    apply = jax.jit(FORWARD[mode], static_argnums=0)
    assert_trees_close(apply(lib, p, x), apply(ref, p, x), **TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_krylov_forward_mode_custom_jvp_operator_kinds(kind):
    # jacfwd with respect to every array the operator holds and to x0.
    p, _, build = _params(kind)
    x, _ = _x0()
    lib, ref = _krylov_fns(build, "scan", "custom_jvp")
    apply = jax.jit(FORWARD["jacfwd"], static_argnums=0)
    assert_trees_close(apply(lib, p, x), apply(ref, p, x), **TOL)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", ["jvp", "jacfwd"])
def test_krylov_forward_mode_raises_with_custom_vjp(method, mode):
    p, _, build = _params("dense")
    x, _ = _x0()
    lib, _ = _krylov_fns(build, method)
    with pytest.raises(TypeError, match=FORWARD_MODE_ERROR):
        FORWARD[mode](lib, p, x)


@pytest.mark.parametrize("method", METHODS)
def test_krylov_hessian_with_custom_vjp(method):
    # `jax.hessian` is forward-over-reverse: the outer JVP differentiates the
    # hand-written reverse pass, an ordinary function, so it works and is exact.
    p, _, build = _params("dense")
    x, _ = _x0()
    lib, ref = _krylov_fns(build, method)
    apply = jax.jit(FORWARD["hessian"], static_argnums=0)
    assert_trees_close(apply(lib, p, x), apply(ref, p, x), **TOL)


# ---------------------------------------------------------------------- iterate


def _mlps():
    keys = jr.split(jr.key(0), BATCH + 1)
    mlps = [MLP(k, state=N, width=5) for k in keys]
    return mlps[0], _stack(mlps[1:])


ITERATE_ADJOINTS = ("custom_vjp", "custom_jvp")


def _iterate_fns(adjoint="custom_vjp"):
    def lib(m, x):
        return krylovjax.iterate(m, x, D, adjoint=adjoint).T

    def ref(m, x):
        return iterate_scan_reference(m, x, D).T

    return lib, ref


@pytest.mark.parametrize("adjoint", ITERATE_ADJOINTS)
@pytest.mark.parametrize(
    "transform", ["jit", "vmap_x0", "vmap_both", "grad", "vmap_grad", "grad_grad"]
)
def test_iterate_transforms(adjoint, transform):
    m, ms = _mlps()
    x, xs = _x0()
    lib, ref = _iterate_fns(adjoint)
    apply = jax.jit(TRANSFORMS[transform], static_argnums=0)
    assert_trees_close(apply(lib, m, ms, x, xs), apply(ref, m, ms, x, xs), **TOL)


ITERATE_FORWARD = {
    "jvp": lambda f, m, x: jax.jvp(lambda x: f(m, x), (x,), (jnp.ones_like(x),)),
    "jacfwd": lambda f, m, x: jax.jacfwd(f, (0, 1))(m, x),
    "hessian": lambda f, m, x: jax.hessian(_loss(f), 1)(m, x),
}


@pytest.mark.parametrize("adjoint", ["custom_jvp", "autodiff"])
@pytest.mark.parametrize("mode", list(ITERATE_FORWARD))
def test_iterate_forward_mode(adjoint, mode):
    m, _ = _mlps()
    x, _ = _x0()
    lib, ref = _iterate_fns(adjoint)
    apply = jax.jit(ITERATE_FORWARD[mode], static_argnums=0)
    assert_trees_close(apply(lib, m, x), apply(ref, m, x), **TOL)


@pytest.mark.parametrize("mode", ["jvp", "jacfwd"])
def test_iterate_forward_mode_raises_with_custom_vjp(mode):
    m, _ = _mlps()
    x, _ = _x0()
    lib, _ = _iterate_fns()
    with pytest.raises(TypeError, match=FORWARD_MODE_ERROR):
        ITERATE_FORWARD[mode](lib, m, x)


def test_iterate_hessian_with_custom_vjp():
    m, _ = _mlps()
    x, _ = _x0()
    lib, ref = _iterate_fns()
    apply = jax.jit(ITERATE_FORWARD["hessian"], static_argnums=0)
    assert_trees_close(apply(lib, m, x), apply(ref, m, x), **TOL)


# A Python float that a callable closes over, as `jax.grad(f)(0.7)` and
# `jax.jvp(f, (0.7,), ...)` trace it: a tracer whose value is a Python scalar type,
# not an array. Its derivative was dropped (zero with `custom_vjp`) or the rule
# failed with a `TypeError`.
M_T = random_matrix(jr.key(21), N, jnp.float64) / 2
X0_T = random_array(jr.key(22), (N,), jnp.float64)
PYTHON_FLOAT_CASES = {
    ("krylov", "scan", None): lambda t: krylovjax.krylov(
        lambda x: t * (M_T @ x), X0_T, D
    ),
    ("krylov", "scan", "custom_vjp"): lambda t: krylovjax.krylov(
        lambda x: t * (M_T @ x), X0_T, D, adjoint="custom_vjp"
    ),
    ("krylov", "doubling", None): lambda t: krylovjax.krylov(
        lambda x: t * (M_T @ x), X0_T, D, method="doubling"
    ),
    ("iterate", "custom_jvp"): lambda t: krylovjax.iterate(
        lambda x: jnp.tanh(t * (M_T @ x)), X0_T, D
    ),
    ("iterate", "custom_vjp"): lambda t: krylovjax.iterate(
        lambda x: jnp.tanh(t * (M_T @ x)), X0_T, D, adjoint="custom_vjp"
    ),
    ("funm_action",): lambda t: krylovjax.funm_action(
        jnp.exp, lambda x: t * ((M_T + M_T.T) @ x), X0_T, D, method="lanczos"
    ),
}


@pytest.mark.parametrize("case", list(PYTHON_FLOAT_CASES), ids=str)
def test_derivative_in_a_python_float_that_a_callable_closes_over(case):
    f = PYTHON_FLOAT_CASES[case]

    # `krylov` stacks its vectors as columns, `iterate` along the first axis.
    weights = {"krylov": CT, "iterate": CT.T, "funm_action": CT[:, 0]}[case[0]]

    def loss(t):
        return jnp.sum(weights * f(t))

    expected = jax.grad(loss)(jnp.asarray(0.7))
    assert_trees_close(jax.grad(loss)(0.7), expected, **TOL)
    if "custom_vjp" not in case and "doubling" not in case:  # reverse-only rules
        assert_trees_close(jax.jvp(loss, (0.7,), (1.0,))[1], expected, **TOL)
    if case[0] == "krylov":
        # sum_k t^k <c_k, M^k x0>, differentiated: sum_k k t^(k-1) <c_k, M^k x0>.
        powers = [jnp.linalg.matrix_power(M_T, k) @ X0_T for k in range(D)]
        closed = sum(k * 0.7 ** (k - 1) * (CT[:, k] @ powers[k]) for k in range(1, D))
        assert_trees_close(expected, closed, **TOL)
