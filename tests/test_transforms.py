"""`krylov` and `iterate` under jit, vmap, grad, checkpoint and forward mode.

Each test runs the library under every transform it checks, and a plain `lax.scan`
reference under each of those transforms once, in one jitted program; the data are
NumPy arrays (compiling is what the tests spend their time on).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import (
    MLP,
    as_mv,
    assert_trees_close,
    iterate_scan_reference,
    krylov_numpy,
    krylov_scan_reference,
    numpy_array,
    numpy_operator,
    scalar_loss,
    tol,
)
from jax.sharding import PartitionSpec as P

import krylovjax

N, D, BATCH = 4, 4, 3
TOL = tol(jnp.float64)
FORWARD_MODE_ERROR = "can't apply forward-mode autodiff"


def _stack(trees):
    return jax.tree.map(lambda *xs: np.stack(xs), *trees)


def _params(kind, seed=0):
    """Operator parameters for one problem and for a batch of BATCH problems."""
    matrices = [
        numpy_array((seed, i), (N, N), jnp.float64) * (0.9 / np.sqrt(N))
        for i in range(BATCH + 1)
    ]
    ops = [numpy_operator(kind, A) for A in matrices]
    build = ops[0][1]
    return ops[0][0], _stack([p for p, _ in ops[1:]]), build


def _x0(seed=1):
    x0s = numpy_array(seed, (BATCH + 1, N), jnp.float64)
    return x0s[0], x0s[1:]


CT = numpy_array(9, (N, D), jnp.float64)


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


def _check_all(cases, ref, transforms, *args):
    """Run each `(name, transform, lib)` of `cases` on `args`, and `ref` under each
    transform named once, all in one program, and compare the library's result
    with the reference's under the same transform (`transforms[transform]`)."""
    names = list(dict.fromkeys(transform for _, transform, _ in cases))

    @jax.jit
    def run(*args):
        want = {name: transforms[name](ref, *args) for name in names}
        return [transforms[t](lib, *args) for _, t, lib in cases], want

    got, want = run(*args)
    for (name, transform, _), result in zip(cases, got, strict=True):
        try:
            assert_trees_close(result, want[transform], **TOL)
        except AssertionError as error:
            msg = f"{name}: {error}"
            raise AssertionError(msg) from None


# Every rule of each method: `krylov`'s are the scan's custom_vjp and custom_jvp and
# doubling's custom_vjp.
RULES = [("scan", "custom_vjp"), ("scan", "custom_jvp"), ("doubling", "custom_vjp")]


def test_krylov_transforms_dense():
    """Every transform of `TRANSFORMS` for each rule of each method (`RULES`) on a
    dense matrix equals the reference's."""
    p, ps, build = _params("dense")
    x, xs = _x0()
    cases = []
    for method, adjoint in RULES:
        lib, ref = _krylov_fns(build, method, adjoint)
        cases += [(f"{method}-{adjoint}-{name}", name, lib) for name in TRANSFORMS]
    # `ref` is the same for every rule: it depends on the operator only.
    _check_all(cases, ref, TRANSFORMS, p, ps, x, xs)


# "closure" and "module" reach the same code path as "method": every callable is
# closure-converted, its arrays made explicit leaves (as in
# test_krylov.py::test_grads_finite_differences).
@pytest.mark.parametrize("kind", ["bcoo", "method"])
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
        cases += [(f"{method}-{adjoint}-{name}", name, lib) for name in names]
    _check_all(cases, ref, TRANSFORMS | FORWARD_TRANSFORMS, p, ps, x, xs)


@pytest.mark.parametrize("method", ["scan", "doubling"])
def test_krylov_jit_with_static_depth(method):
    # The depth as a static argument: the program at d = D, and the output's shape
    # at another d (traced for it, not run).
    p, _, _ = _params("dense")
    x, _ = _x0()
    f = jax.jit(krylovjax.krylov, static_argnums=2, static_argnames="method")
    assert_trees_close(f(p, x, D, method=method), krylov_numpy(p, x, D))
    assert f.eval_shape(p, x, 2, method=method).shape == (N, 2)


# ----------------------------------------------------------------- forward mode

FORWARD = {
    "jvp": lambda f, p, x: jax.jvp(f, (p, x), (jnp.ones_like(p), jnp.ones_like(x))),
    "jacfwd": lambda f, p, x: jax.jacfwd(f, (0, 1))(p, x),
    "hessian": lambda f, p, x: jax.hessian(_squares_loss(f), (0, 1))(p, x),
}


def _forward_transform(mode):
    """`FORWARD[mode]` in the signature of `TRANSFORMS`."""
    return lambda f, p, ps, x, xs: FORWARD[mode](f, p, x)


FORWARD_TRANSFORMS = {mode: _forward_transform(mode) for mode in FORWARD}

# Every forward mode for each rule that has one; `jax.hessian` (forward over reverse)
# also with the custom_vjp: its outer JVP differentiates the hand-written reverse
# pass, an ordinary function, so it works and is exact. The scan's autodiff is JAX's
# own transformation of `lax.scan`: one mode shows that it is what runs.
FORWARD_CASES = [
    ("scan", "custom_jvp", list(FORWARD)),
    ("scan", "autodiff", ["jvp"]),
    ("doubling", "autodiff", list(FORWARD)),
    ("scan", "custom_vjp", ["hessian"]),
    ("doubling", "custom_vjp", ["hessian"]),
]


def test_krylov_forward_mode():
    """Each forward mode of `FORWARD_CASES` equals the reference's."""
    p, ps, build = _params("dense")
    x, xs = _x0()
    cases = []
    for method, adjoint, modes in FORWARD_CASES:
        lib, ref = _krylov_fns(build, method, adjoint)
        cases += [(f"{method}-{adjoint}-{mode}", mode, lib) for mode in modes]
    _check_all(cases, ref, FORWARD_TRANSFORMS, p, ps, x, xs)


@pytest.mark.parametrize("method", ["scan", "doubling"])
@pytest.mark.parametrize("mode", ["jvp", "jacfwd"])
def test_krylov_forward_mode_raises_with_custom_vjp(method, mode):
    p, _, build = _params("dense")
    x, _ = _x0()
    lib, _ = _krylov_fns(build, method)
    # Under jit the error comes before anything is compiled; eagerly, `jacfwd`'s
    # basis and the tangents would each compile a program first.
    with pytest.raises(TypeError, match=FORWARD_MODE_ERROR):
        jax.jit(lambda p, x: FORWARD[mode](lib, p, x))(p, x)


# ---------------------------------------------------------------------- iterate


def _mlp(seed):
    """An `MLP(key, state=N, width=5)` with NumPy weights at the scales of its
    initialiser: the module's structure is traced, not run (`jax.random` compiles
    a program for every shape it draws)."""
    mlp = eqx.filter_eval_shape(lambda: MLP(jr.key(0), state=N, width=5))
    leaves, treedef = jax.tree.flatten(mlp)  # w1, b1, w2, b2
    scales = [1 / np.sqrt(N), 0.1, 1 / np.sqrt(5), 0.1]
    arrays = [
        numpy_array((seed, i), leaf.shape, leaf.dtype) * scale
        for i, (leaf, scale) in enumerate(zip(leaves, scales, strict=True))
    ]
    return jax.tree.unflatten(treedef, arrays)


def _mlps():
    """One MLP and a stack of BATCH."""
    mlps = [_mlp(seed) for seed in range(BATCH + 1)]
    return mlps[0], _stack(mlps[1:])


def _iterate_fns(adjoint="custom_vjp"):
    def lib(m, x):
        return krylovjax.iterate(m, x, D, adjoint=adjoint).T

    def ref(m, x):
        return iterate_scan_reference(m, x, D).T

    return lib, ref


ITERATE_TRANSFORMS = ["jit", "vmap_x0", "vmap_both", "grad", "vmap_grad", "grad_grad"]


def test_iterate_transforms():
    """`iterate` with each of its rules, custom_vjp and custom_jvp, under every
    transform of `ITERATE_TRANSFORMS` equals the reference's."""
    m, ms = _mlps()
    x, xs = _x0()
    cases = []
    for adjoint in ("custom_vjp", "custom_jvp"):
        lib, ref = _iterate_fns(adjoint)
        cases += [(f"{adjoint}-{name}", name, lib) for name in ITERATE_TRANSFORMS]
    _check_all(cases, ref, TRANSFORMS, m, ms, x, xs)


ITERATE_FORWARD = {
    "jvp": lambda f, m, x: jax.jvp(lambda x: f(m, x), (x,), (jnp.ones_like(x),)),
    "jacfwd": lambda f, m, x: jax.jacfwd(f, (0, 1))(m, x),
    "hessian": lambda f, m, x: jax.hessian(_squares_loss(f), 1)(m, x),
}


# `jax.hessian` also with the custom_vjp (forward over its reverse pass). The
# autodiff rule is JAX's own transformation of `lax.scan`: one mode shows it runs.
ITERATE_FORWARD_CASES = [
    ("custom_jvp", list(ITERATE_FORWARD)),
    ("autodiff", ["jvp"]),
    ("custom_vjp", ["hessian"]),
]


def test_iterate_forward_mode():
    """Each forward mode of `ITERATE_FORWARD_CASES` equals the reference's."""
    m, _ = _mlps()
    x, _ = _x0()
    cases = []
    for adjoint, modes in ITERATE_FORWARD_CASES:
        lib, ref = _iterate_fns(adjoint)
        cases += [(f"{adjoint}-{mode}", mode, lib) for mode in modes]
    _check_all(cases, ref, ITERATE_FORWARD, m, x)


@pytest.mark.parametrize("mode", ["jvp", "jacfwd"])
def test_iterate_forward_mode_raises_with_custom_vjp(mode):
    m, _ = _mlps()
    x, _ = _x0()
    lib, _ = _iterate_fns()
    # Under jit, as in test_krylov_forward_mode_raises_with_custom_vjp.
    with pytest.raises(TypeError, match=FORWARD_MODE_ERROR):
        jax.jit(lambda m, x: ITERATE_FORWARD[mode](lib, m, x))(m, x)


# A Python float that a callable closes over, as `jax.grad(f)(0.7)` and
# `jax.jvp(f, (0.7,), ...)` trace it: a tracer whose value is a Python scalar type,
# not an array. Its derivative was dropped (zero with `custom_vjp`) or the rule
# failed with a `TypeError`.
M_T = numpy_array(21, (N, N), jnp.float64) * (0.45 / np.sqrt(N))
X0_T = numpy_array(22, (N,), jnp.float64)
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


def test_derivative_in_a_python_float_that_a_callable_closes_over():
    """For every case of `PYTHON_FLOAT_CASES`, `grad` at the Python float 0.7 and,
    for the rules with a forward mode, `jvp` at it equal `grad` at the array 0.7;
    for `krylov`, that is the closed form."""

    def derivatives(case, f):
        # `krylov` stacks its vectors as columns, `iterate` along the first axis.
        weights = {"krylov": CT, "iterate": CT.T, "funm_action": CT[:, 0]}[case[0]]

        def loss(t):
            return jnp.sum(weights * f(t))

        forward = "custom_vjp" not in case and "doubling" not in case  # reverse-only
        expected = jax.grad(loss)(jnp.asarray(0.7))
        tangent = jax.jvp(loss, (0.7,), (1.0,))[1] if forward else expected
        return expected, jax.grad(loss)(0.7), tangent

    # In one program; the Python float stays a Python float inside it, the primal of
    # the tracer that `grad` and `jvp` make.
    results = jax.jit(
        lambda: [derivatives(case, f) for case, f in PYTHON_FLOAT_CASES.items()]
    )()
    # sum_k t^k <c_k, M^k x0>, differentiated: sum_k k t^(k-1) <c_k, M^k x0>.
    powers = [np.linalg.matrix_power(M_T, k) @ X0_T for k in range(D)]
    closed = sum(k * 0.7 ** (k - 1) * (CT[:, k] @ powers[k]) for k in range(1, D))
    cases = list(PYTHON_FLOAT_CASES)
    for case, (expected, grad, tangent) in zip(cases, results, strict=True):
        for name, value in [("grad", grad), ("jvp", tangent)]:
            try:
                assert_trees_close(value, expected, **TOL)
            except AssertionError as error:
                msg = f"{case} {name}: {error}"
                raise AssertionError(msg) from None
        if case[0] == "krylov":
            assert_trees_close(expected, closed, **TOL, err_msg=str(case))


def test_inside_shard_map():
    """Inside `jax.shard_map` (one device here: the manual axis types are the
    same on any number): with `check_vma=False` every function computes on the
    device's arrays what it does outside, values and gradients; with the default
    `check_vma=True` a varying start vector gives a `ValueError` that says so,
    from the decompositions and from the derivative rules."""
    mesh = jax.make_mesh((1,), ("b",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    S = rng.standard_normal((6, 6))
    S = (S + S.T) / 4
    X = rng.standard_normal((1, 6))
    fns = {
        "krylov": lambda A, x: krylovjax.krylov(A, x, 4),
        "chebyshev": lambda A, x: krylovjax.krylov(
            A, x, 4, basis=krylovjax.Chebyshev(-3.0, 3.0)
        ),
        "doubling": lambda A, x: krylovjax.krylov(A, x, 4, method="doubling"),
        "readout": lambda A, x: krylovjax.polynomial_action(A, x, jnp.ones(4)),
        "iterate": lambda A, x: krylovjax.iterate(lambda v: jnp.tanh(A @ v), x, 4),
        "lanczos": lambda A, x: krylovjax.lanczos(A, x, 4).basis,
        "funm_action": lambda A, x: krylovjax.funm_action(
            jnp.exp, A, x, 4, method="lanczos"
        ),
    }

    def value_and_grad(f):
        return jax.value_and_grad(lambda A, x: jnp.sum(jnp.sin(f(A, x))), (0, 1))

    def mapped(f, check_vma):
        def local(A, X):
            value, (g_A, g_x) = value_and_grad(f)(A, X[0])
            return value[None], g_A, g_x[None]

        specs = (P(), P("b"))
        out = (P("b"), P(), P("b"))
        return jax.shard_map(
            local, mesh=mesh, in_specs=specs, out_specs=out, check_vma=check_vma
        )

    for name, f in fns.items():
        value, (g_A, g_x) = jax.jit(value_and_grad(f))(S, X[0])
        got = jax.jit(mapped(f, check_vma=False))(S, X)
        assert_trees_close(got, (value[None], g_A, g_x[None]), **TOL, err_msg=name)
        with pytest.raises(ValueError, match=r"pass `check_vma=False`"):
            jax.jit(mapped(f, check_vma=True))(S, X)
