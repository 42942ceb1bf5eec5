"""`krylov` and `iterate` under jit, vmap, grad, checkpoint and forward mode."""

import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from helpers import (
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
    scalar_loss,
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


def _squares_loss(f):
    # Nonlinear in the output, so that second derivatives are not trivially zero.
    return lambda p, x: scalar_loss(f(p, x), "weighted_squares", CT)


TRANSFORMS = {
    "jit": lambda f, p, ps, x, xs: jax.jit(f)(p, x),
    "vmap_x0": lambda f, p, ps, x, xs: jax.vmap(f, (None, 0))(p, xs),
    "vmap_A": lambda f, p, ps, x, xs: jax.vmap(f, (0, None))(ps, x),
    "vmap_both": lambda f, p, ps, x, xs: jax.vmap(f)(ps, xs),
    "grad": lambda f, p, ps, x, xs: jax.grad(_squares_loss(f), (0, 1))(p, x),
    "vmap_grad": lambda f, p, ps, x, xs: jax.vmap(jax.grad(_squares_loss(f), (0, 1)))(
        ps, xs
    ),
    "grad_grad": lambda f, p, ps, x, xs: jax.grad(
        lambda p, x: jnp.sum(jnp.sin(jax.grad(_squares_loss(f), 1)(p, x))), (0, 1)
    )(p, x),
    "checkpoint": lambda f, p, ps, x, xs: jax.grad(
        _squares_loss(jax.checkpoint(f)), (0, 1)
    )(p, x),
}


def _krylov_fns(build, method, adjoint="custom_vjp"):
    def lib(p, x):
        return krylovjax.krylov(build(p), x, D, adjoint=adjoint, method=method)

    def ref(p, x):
        return krylov_scan_reference(as_mv(build(p)), x, D)

    return lib, ref


def _check_all(cases, *args):
    """Run each `(name, transform, lib, ref)` of `cases` on `args`, all in one
    program, and compare the library's result with the reference's."""

    @jax.jit
    def run(*args):
        return [(t(lib, *args), t(ref, *args)) for _, t, lib, ref in cases]

    for (name, *_), (got, want) in zip(cases, run(*args), strict=True):
        try:
            assert_trees_close(got, want, **TOL)
        except AssertionError as error:
            msg = f"{name}: {error}"
            raise AssertionError(msg) from None


# Every transform for each rule of each method, in one program per rule.
@grid(method=METHODS, adjoint=("custom_vjp", "custom_jvp"))
def test_krylov_transforms_dense(method, adjoint):
    p, ps, build = _params("dense")
    x, xs = _x0()
    lib, ref = _krylov_fns(build, method, adjoint)
    cases = [(name, t, lib, ref) for name, t in TRANSFORMS.items()]
    _check_all(cases, p, ps, x, xs)


# "module" reaches the same code path as "method" (an Equinox module's arrays).
@pytest.mark.parametrize("kind", ["bcoo", "closure", "method"])
def test_krylov_transforms_operator_kinds(kind):
    # For each kind of operator, in one program: vmap over a batch of operators and
    # grad of grad for both methods' custom_vjp; the scan's custom_jvp under grad of
    # grad (its JVP rule, the rule's transposition and the JVP of that) and jacfwd
    # with respect to every array the operator holds and to x0. vmap of the
    # custom_jvp forward pass is the plain scan's and is covered on "dense".
    p, ps, build = _params(kind)
    x, xs = _x0()
    cases = []
    for method, adjoint, names in [
        ("scan", "custom_vjp", ["vmap_both", "grad_grad"]),
        ("doubling", "custom_vjp", ["vmap_both", "grad_grad"]),
        ("scan", "custom_jvp", ["grad_grad", "jacfwd"]),
    ]:
        lib, ref = _krylov_fns(build, method, adjoint)
        for name in names:
            transform = TRANSFORMS.get(name) or _forward_transform(name)
            cases.append((f"{method}-{adjoint}-{name}", transform, lib, ref))
    _check_all(cases, p, ps, x, xs)


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
    "hessian": lambda f, p, x: jax.hessian(_squares_loss(f), (0, 1))(p, x),
}


def _forward_transform(mode):
    """`FORWARD[mode]` in the signature of `TRANSFORMS`."""
    return lambda f, p, ps, x, xs: FORWARD[mode](f, p, x)


# Every forward mode for each rule that has one; `jax.hessian` (forward over reverse)
# also with the custom_vjp: its outer JVP differentiates the hand-written reverse
# pass, an ordinary function, so it works and is exact. The scan's autodiff is JAX's
# own transformation of `lax.scan`: one mode shows that it is what runs.
@pytest.mark.parametrize(
    "method, adjoint, modes",
    [
        ("scan", "custom_jvp", list(FORWARD)),
        ("scan", "autodiff", ["jvp"]),
        ("doubling", "autodiff", list(FORWARD)),
        ("scan", "custom_vjp", ["hessian"]),
        ("doubling", "custom_vjp", ["hessian"]),
    ],
)
def test_krylov_forward_mode(method, adjoint, modes):
    p, ps, build = _params("dense")
    x, xs = _x0()
    lib, ref = _krylov_fns(build, method, adjoint)
    cases = [(mode, _forward_transform(mode), lib, ref) for mode in modes]
    _check_all(cases, p, ps, x, xs)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", ["jvp", "jacfwd"])
def test_krylov_forward_mode_raises_with_custom_vjp(method, mode):
    p, _, build = _params("dense")
    x, _ = _x0()
    lib, _ = _krylov_fns(build, method)
    with pytest.raises(TypeError, match=FORWARD_MODE_ERROR):
        FORWARD[mode](lib, p, x)


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
def test_iterate_transforms(adjoint):
    m, ms = _mlps()
    x, xs = _x0()
    lib, ref = _iterate_fns(adjoint)
    names = ["jit", "vmap_x0", "vmap_both", "grad", "vmap_grad", "grad_grad"]
    _check_all([(name, TRANSFORMS[name], lib, ref) for name in names], m, ms, x, xs)


ITERATE_FORWARD = {
    "jvp": lambda f, m, x: jax.jvp(lambda x: f(m, x), (x,), (jnp.ones_like(x),)),
    "jacfwd": lambda f, m, x: jax.jacfwd(f, (0, 1))(m, x),
    "hessian": lambda f, m, x: jax.hessian(_squares_loss(f), 1)(m, x),
}


# `jax.hessian` also with the custom_vjp (forward over its reverse pass). The
# autodiff rule is JAX's own transformation of `lax.scan`: one mode shows it runs.
@pytest.mark.parametrize(
    "adjoint, modes",
    [
        ("custom_jvp", list(ITERATE_FORWARD)),
        ("autodiff", ["jvp"]),
        ("custom_vjp", ["hessian"]),
    ],
)
def test_iterate_forward_mode(adjoint, modes):
    m, _ = _mlps()
    x, _ = _x0()
    lib, ref = _iterate_fns(adjoint)

    def transform(mode):
        return lambda f, m, x: ITERATE_FORWARD[mode](f, m, x)

    _check_all([(mode, transform(mode), lib, ref) for mode in modes], m, x)


@pytest.mark.parametrize("mode", ["jvp", "jacfwd"])
def test_iterate_forward_mode_raises_with_custom_vjp(mode):
    m, _ = _mlps()
    x, _ = _x0()
    lib, _ = _iterate_fns()
    with pytest.raises(TypeError, match=FORWARD_MODE_ERROR):
        ITERATE_FORWARD[mode](lib, m, x)


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

    forward = "custom_vjp" not in case and "doubling" not in case  # reverse-only rules

    # In one program; the Python float stays a Python float inside it, the primal of
    # the tracer that `grad` and `jvp` make.
    @jax.jit
    def derivatives():
        expected = jax.grad(loss)(jnp.asarray(0.7))
        tangent = jax.jvp(loss, (0.7,), (1.0,))[1] if forward else expected
        return expected, jax.grad(loss)(0.7), tangent

    expected, grad, tangent = derivatives()
    assert_trees_close(grad, expected, **TOL)
    assert_trees_close(tangent, expected, **TOL)
    if case[0] == "krylov":
        # sum_k t^k <c_k, M^k x0>, differentiated: sum_k k t^(k-1) <c_k, M^k x0>.
        powers = [jnp.linalg.matrix_power(M_T, k) @ X0_T for k in range(D)]
        closed = sum(k * 0.7 ** (k - 1) * (CT[:, k] @ powers[k]) for k in range(1, D))
        assert_trees_close(expected, closed, **TOL)
