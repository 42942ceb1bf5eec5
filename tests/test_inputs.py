"""Inputs that used to be accepted wrongly or reported misleadingly.

Matrix types that `krylov` does not take, dtypes as they came in, outputs too large to
build, nonlinear and affine callables, `None` in an `iterate` state, the leaf that a
step gets wrong, and JAX's weak-type promotion.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import (
    METHODS,
    Linear,
    MatVec,
    assert_trees_close,
    krylov_loop,
    tol,
    unchecked,
)
from jax.experimental import sparse

import krylovjax

A = jnp.eye(3) / 2
X0 = jnp.ones(3)
M = jnp.array([[0.5, 0.1, 0.0], [0.2, 0.3, 0.1], [0.0, 0.4, 0.6]])
C = jnp.array([1.0, -2.0, 0.5])
MASK = np.array([True, False, True])
M_BCOO = sparse.BCOO.fromdense(M)


def _m(text):
    return re.escape(text)


# ------------------------------------------------------- matrix types not taken


@pytest.mark.parametrize(
    "method, kind",
    [("scan", "csr_matrix"), ("doubling", "csr_array"), ("scan", "coo_matrix")],
)
def test_krylov_scipy_sparse_matrix(method, kind):
    scipy_sparse = pytest.importorskip("scipy.sparse")
    bad = getattr(scipy_sparse, kind)(np.asarray(A))
    msg = (
        f"`krylov(A=...)` must be a square array, a `jax.experimental.sparse.BCOO` "
        f"matrix or a callable; got a SciPy sparse matrix of type {kind}. Convert it "
        f"with `jax.experimental.sparse.BCOO.from_scipy_sparse(A)`."
    )
    with pytest.raises(TypeError, match=_m(msg)):
        unchecked(krylovjax.krylov)(bad, X0, 3, method=method)
    # The conversion the message suggests works.
    out = krylovjax.krylov(sparse.BCOO.from_scipy_sparse(bad), X0, 3, method=method)
    np.testing.assert_allclose(out, krylov_loop(lambda x: A @ x, X0, 3))


@pytest.mark.parametrize("method", METHODS)
def test_krylov_bcsr_matrix(method):
    bad = sparse.BCSR.fromdense(A)
    msg = "got a `jax.experimental.sparse.BCSR` matrix. Convert it with `A.to_bcoo()`."
    with pytest.raises(TypeError, match=_m(msg)):
        unchecked(krylovjax.krylov)(bad, X0, 3, method=method)
    out = krylovjax.krylov(bad.to_bcoo(), X0, 3, method=method)
    np.testing.assert_allclose(out, krylov_loop(lambda x: A @ x, X0, 3))


@pytest.mark.parametrize("method", METHODS)
def test_krylov_masked_array_matrix(method):
    # Never its raw data: the masked entries (here the off-diagonal 7s) have no value.
    data = np.where(np.eye(3, dtype=bool), 0.5, 7.0)
    bad = np.ma.masked_array(data, mask=~np.eye(3, dtype=bool))
    msg = "got a NumPy masked array, whose masked entries have no value to use. Fill "
    with pytest.raises(TypeError, match=_m(msg) + ".*" + _m("`np.ma.filled(A, 0)`")):
        krylovjax.krylov(bad, X0, 3, method=method)


@pytest.mark.parametrize("fn", ["krylov", "iterate"])
def test_masked_array_x0(fn):
    bad = np.ma.masked_array(np.ones(3), mask=[False, True, False])
    msg = f"`{fn}(x0=...)` must be an array; got a NumPy masked array"
    with pytest.raises(TypeError, match=_m(msg)):
        if fn == "krylov":
            krylovjax.krylov(A, bad, 3)
        else:
            krylovjax.iterate(jnp.sin, {"a": bad}, 3)


def test_krylov_unknown_object_with_shape_and_dtype():
    bad = jax.ShapeDtypeStruct((3, 3), jnp.float32)
    msg = "got an object of type ShapeDtypeStruct with shape (3, 3) and dtype float32."
    with pytest.raises(TypeError, match=_m(msg)):
        unchecked(krylovjax.krylov)(bad, X0, 3)


# ------------------------------------------------------ dtypes as they came in


@pytest.mark.parametrize(
    ("fn", "which", "value"),
    [
        ("krylov", "A", np.eye(3, dtype=np.int64)),
        ("krylov", "A", np.eye(3, dtype=np.uint64)),
        ("krylov", "x0", np.ones(3, np.int64)),
        ("iterate", "x0", np.ones(3, np.int64)),
    ],
)
def test_integer_dtype_reported_as_given(fn, which, value):
    # With x64 disabled, `jnp.asarray` would turn int64 into int32 before the check.
    msg = (
        f"`{fn}({which}=...)` must have a floating-point or complex dtype; got dtype "
        f"{value.dtype}."
    )
    with jax.enable_x64(False), pytest.raises(TypeError, match=_m(msg)):
        if fn == "iterate":
            krylovjax.iterate(lambda s: s, (jnp.ones(2), value), 3)
        else:
            kwargs = {"A": A, "x0": X0, which: value}
            krylov = unchecked(krylovjax.krylov)
            jax.jit(lambda: krylov(kwargs["A"], kwargs["x0"], 3))()


# ------------------------------------------------------------ outputs too large


def _call(fn, d):
    if fn == "iterate":
        step = lambda s: jax.tree_util.tree_map(jnp.sin, s)  # noqa: E731
        return krylovjax.iterate(step, {"a": X0, "b": None}, d)
    return krylovjax.krylov(A, X0, d, method=fn)


@pytest.mark.parametrize("d", [2**40, 2**62])
@pytest.mark.parametrize("fn", [*METHODS, "iterate"])
def test_output_too_large(fn, d):
    # Raised while tracing (`jax.eval_shape` allocates nothing, so this test cannot
    # exhaust memory, whatever the code does), naming `d` and the bytes needed.
    name = "iterate" if fn == "iterate" else "krylov"
    size = X0.size * X0.dtype.itemsize
    msg = f"`{name}(d=...)` is too large: {d} stacked copies of `x0` ({size} bytes "
    with pytest.raises(ValueError, match=_m(msg + f"each) take {size * d} bytes")):
        jax.eval_shape(lambda: _call(fn, d))


@pytest.mark.parametrize("fn", ["scan", "iterate"])
def test_depth_beyond_int32_counter(fn):
    # With x64 disabled `lax.scan` counts in int32, so d - 1 <= 2**31 - 1.
    name = "iterate" if fn == "iterate" else "krylov"
    msg = f"`{name}(d=...)` must be at most 2147483648: the d - 1 steps are counted in "
    with jax.enable_x64(False), pytest.raises(ValueError, match=_m(msg + "int32")):
        jax.eval_shape(lambda: _call(fn, 2**31 + 1))


@pytest.mark.parametrize("fn", [*METHODS, "iterate"])
def test_large_but_feasible_depth_traces(fn):
    # The limits leave a large output that fits alone: 2**20 vectors of 24 bytes.
    out = jax.eval_shape(lambda: _call(fn, 2**20))
    shapes = [leaf.shape for leaf in jax.tree_util.tree_leaves(out)]
    assert shapes == [(2**20, 3) if fn == "iterate" else (3, 2**20)]


# --------------------------------------------------- nonlinear and affine maps


class _Affine(eqx.Module):
    weight: jax.Array
    bias: jax.Array

    def __call__(self, x):
        return self.weight @ x + self.bias


def _with_custom_vjp(fn):
    """`fn` as a `jax.custom_vjp` function whose backward pass is JAX's own VJP."""
    wrapped = jax.custom_vjp(fn)
    wrapped.defvjp(lambda x: (fn(x), x), lambda x, ct: jax.vjp(fn, x)[1](ct))
    return wrapped


NONLINEAR = {
    "sin": jnp.sin,
    "square": lambda x: x * x,
    "abs": jnp.abs,
    "relu": jax.nn.relu,
    "normalise": lambda x: x / jnp.linalg.norm(x),
    "where_positive": lambda x: jnp.where(x > 0, x, 0.0),
    "custom_vjp": _with_custom_vjp(jnp.sin),
}
AFFINE = {
    "matrix_plus_vector": lambda x: M @ x + C,
    "plus_literal": lambda x: x + 1.0,
    "constant": lambda x: C,
    "where_vector": lambda x: jnp.where(MASK, x, C),
    "pad_one": lambda x: jnp.pad(x, 1, constant_values=1.0)[1:-1],
    "set_one": lambda x: x.at[0].set(1.0),
    "module_with_bias": _Affine(M, C),
    "scan_plus_vector": lambda x: jax.lax.scan(
        lambda y, _: (M @ y + C, None), x, length=2
    )[0],
    "jitted": jax.jit(lambda x: M @ x + 1.0),
    "custom_vjp": _with_custom_vjp(lambda x: M @ x + C),
}
LINEAR = {
    "closure": lambda x: M @ x,
    "module": Linear(M),
    "method": MatVec(M, jnp.asarray(0.25)).mv,
    "einsum": lambda x: jnp.einsum("ij,j->i", M, x),
    "fft": lambda x: jnp.fft.ifft(jnp.fft.fft(x) * jnp.arange(3, dtype=complex)).real,
    "where_zero": lambda x: jnp.where(MASK, x, 0.0),
    "set_zero": lambda x: x.at[0].set(0.0),
    "pad_zero": lambda x: jnp.pad(x, 1)[1:-1] + jnp.roll(x, 1),
    "shift_zeros_inside": lambda x: jnp.concatenate([x[1:], jnp.zeros_like(x[:1])]),
    "bcoo": lambda x: M_BCOO @ x,
    "solve": lambda x: jnp.linalg.solve(M + jnp.eye(3), x),
    "scan": lambda x: jax.lax.scan(lambda y, _: (M @ y + y, None), x, length=2)[0],
    "zero": jnp.zeros_like,
    # Linear, but JAX cannot transpose these two.
    "custom_vjp": _with_custom_vjp(lambda x: M @ x),
    "error_if_on_x": lambda x: eqx.error_if(M @ x, jnp.isnan(x).any(), "nan"),
}


@pytest.mark.parametrize("method", ["scan"])
@pytest.mark.parametrize("name", list(NONLINEAR))
def test_krylov_nonlinear_callable(method, name):
    msg = "`krylov(A=...)` must be linear in its input; got a callable that JAX cannot "
    with pytest.raises(TypeError, match=_m(msg) + ".*" + _m("`krylovjax.iterate`")):
        jax.jit(lambda x: krylovjax.krylov(NONLINEAR[name], x, 3, method=method))(X0)


@pytest.mark.parametrize("name", list(AFFINE))
def test_krylov_affine_callable(name):
    msg = "`krylov(A=...)` must be linear in its input, so that A(0) = 0; got a "
    with pytest.raises(TypeError, match=_m(msg + "callable that adds a term")):
        jax.jit(lambda x: krylovjax.krylov(AFFINE[name], x, 3))(X0)


@pytest.mark.parametrize("adjoint", ["custom_vjp", "custom_jvp", "autodiff"])
def test_krylov_nonlinear_gradient_refused(adjoint):
    # The default adjoint used to return a wrong gradient ([3, 3, 3]) here.
    def loss(x):
        return krylovjax.krylov(jnp.sin, x, 3, adjoint=adjoint).sum()

    with pytest.raises(TypeError, match=_m("`krylov(A=...)` must be linear")):
        jax.grad(loss)(X0)


def test_krylov_closed_over_zeros_message_says_what_to_do():
    # The check reads structure, not the values of closed-over JAX arrays: zeros
    # made outside the callable count as a term; the message says how to write it.
    pad = jnp.zeros(1)
    with pytest.raises(TypeError, match=_m("`jnp.zeros_like(x[:1])`")):
        krylovjax.krylov(lambda x: jnp.concatenate([x[1:], pad]), X0, 3)


def test_krylov_affine_with_traced_arrays():
    def loss(weight, bias):
        return krylovjax.krylov(lambda x: weight @ x + bias, X0, 3).sum()

    with pytest.raises(TypeError, match=_m("so that A(0) = 0")):
        jax.grad(loss)(M, C)
    with pytest.raises(TypeError, match=_m("so that A(0) = 0")):
        jax.vmap(jax.grad(loss), in_axes=(0, None))(jnp.stack([M, M]), C)


# Every linear callable once, eagerly, under jit and under vmap in turn.
@pytest.mark.parametrize(
    "name, transform",
    [(name, ("none", "jit", "vmap")[i % 3]) for i, name in enumerate(LINEAR)],
)
def test_krylov_linear_callables_accepted(name, transform):
    fn = LINEAR[name]
    dense = jax.jacrev(fn)(X0)
    want = krylov_loop(lambda x: dense @ x, X0, 4)
    if transform == "vmap":
        xs = jnp.stack([X0, 2 * X0])
        out = jax.vmap(lambda x: krylovjax.krylov(fn, x, 4))(xs)
        np.testing.assert_allclose(out, jnp.stack([want, 2 * want]), **tol(X0.dtype))
        return
    call = (lambda x: krylovjax.krylov(fn, x, 4)) if transform == "none" else None
    call = call or jax.jit(lambda x: krylovjax.krylov(fn, x, 4))
    np.testing.assert_allclose(call(X0), want, **tol(X0.dtype))


@pytest.mark.parametrize("kind", ["closure", "module", "method"])
def test_krylov_linear_callable_traced_arrays_grad(kind):
    # The closed-over arrays are tracers; the check is about x alone.
    build = {
        "closure": lambda w: lambda x: w @ x,
        "module": Linear,
        "method": lambda w: MatVec(w, jnp.asarray(0.25)).mv,
    }[kind]
    cot = jr.normal(jr.key(0), (3, 4))

    def loss(w, adjoint):
        return jnp.vdot(cot, krylovjax.krylov(build(w), X0, 4, adjoint=adjoint))

    got = jax.jit(jax.grad(loss), static_argnums=1)(M, "custom_vjp")
    want = jax.grad(loss)(M, "autodiff")
    np.testing.assert_allclose(got, want, **tol(M.dtype))


# ------------------------------------------------------------ iterate: pytrees


@pytest.mark.parametrize("container", ["tuple", "dict"])
def test_iterate_none_in_state_grad(container):
    w = jnp.asarray(0.7)

    def wrap(a):
        return (a, None) if container == "tuple" else {"a": a, "skip": None}

    def unwrap(s):
        return s[0] if container == "tuple" else s["a"]

    def loss(w, a, adjoint):
        def step(s):
            return wrap(jnp.tanh(w * unwrap(s)) + 0.1 * unwrap(s))

        xs = krylovjax.iterate(step, wrap(a), 4, adjoint=adjoint)
        assert unwrap(xs).shape == (4, 3)
        return jnp.sum(jnp.cos(jnp.arange(3.0)[None] * unwrap(xs)))

    a = jnp.array([0.3, -0.2, 0.9])
    got = jax.grad(loss, argnums=(0, 1))(w, a, "custom_vjp")
    want = jax.grad(loss, argnums=(0, 1))(w, a, "autodiff")
    assert_trees_close(got, want, **tol(a.dtype))
    got_x = jax.grad(lambda a: loss(jax.lax.stop_gradient(w), a, "custom_vjp"))(a)
    np.testing.assert_allclose(got_x, want[1], **tol(a.dtype))


def test_iterate_step_shape_error_names_leaf():
    x0 = {"a": jnp.ones(3), "b": {"c": jnp.ones(2)}}

    def step(s):
        return {"a": s["a"], "b": {"c": s["b"]["c"][:1]}}

    msg = "expected shape (2,), got (1,) for the leaf `x0['b']['c']`."
    with pytest.raises(ValueError, match=_m(msg)):
        krylovjax.iterate(step, x0, 3)


# ------------------------------------------------------------------ weak types


@pytest.mark.parametrize("method, matrix", [("scan", "dense"), ("doubling", "bcoo")])
def test_krylov_weak_x0_takes_matrix_dtype(method, matrix):
    x0 = jax.lax.full((3,), 1.0)
    assert x0.weak_type
    A16 = A.astype(jnp.float16)
    op = A16 if matrix == "dense" else sparse.BCOO.fromdense(A16)
    out = krylovjax.krylov(op, x0, 3, method=method)
    assert out.dtype == (op @ x0).dtype == jnp.float16


@pytest.mark.parametrize("method", METHODS)
def test_krylov_weak_matrix_takes_x0_dtype(method):
    weak = jax.lax.full((3, 3), 0.25)
    assert weak.weak_type
    x0 = X0.astype(jnp.float16)
    out = krylovjax.krylov(weak, x0, 3, method=method)
    assert out.dtype == (weak @ x0).dtype == jnp.float16


# ------------------------------------------------ promotion under strict mode

# conftest.py runs the suite with `jax_numpy_dtype_promotion="strict"`, which forbids
# implicit promotions. `krylov`'s promotion of a matrix with `x0` is part of its API
# and made explicitly, by JAX's standard rules. Each promotion once, the methods and
# matrix kinds in turn.
PROMOTIONS = [
    (jnp.float32, jnp.float64, "scan", "dense"),
    (jnp.float64, jnp.float32, "doubling", "bcoo"),
    (jnp.float16, jnp.float32, "scan", "bcoo"),
    (jnp.complex64, jnp.float32, "doubling", "dense"),
    (jnp.float32, jnp.complex128, "scan", "dense"),
]


@pytest.mark.parametrize(("a_dtype", "x_dtype", "method", "matrix"), PROMOTIONS)
def test_krylov_promotes_by_standard_rules_under_strict(
    a_dtype, x_dtype, method, matrix
):
    assert jax.config.jax_numpy_dtype_promotion == "strict"
    dense, x0 = M.astype(a_dtype), X0.astype(x_dtype)
    op = dense if matrix == "dense" else sparse.BCOO.fromdense(dense)
    # JAX's own product refuses the implicit promotion (a `TypePromotionError`,
    # public as `jax.dtypes.TypePromotionError` only in newer JAX).
    with pytest.raises(ValueError, match="no available implicit dtype promotion"):
        dense @ x0
    out = krylovjax.krylov(op, x0, 4, method=method)
    with jax.numpy_dtype_promotion("standard"):
        dtype = jnp.result_type(dense, x0)
    assert out.dtype == dtype
    # The Krylov vectors of the operands cast to that dtype, by a Python loop.
    wide = dense.astype(dtype)
    want = krylov_loop(lambda x: wide @ x, x0.astype(dtype), 4)
    np.testing.assert_allclose(out, want, **tol(dtype))
