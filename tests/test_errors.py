"""Every bad input raises a `TypeError` or `ValueError` that names the argument.

Most bad inputs lie outside the annotations too; those calls go through
`helpers.unchecked`, which under the runtime type checker also asserts that the
checker rejects them (see its docstring).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import MATRIX_KINDS, METHODS, make_operator, unchecked
from jax.experimental import sparse

import krylovjax

A = jnp.eye(3) / 2
X0 = jnp.ones(3)


def _m(text):
    return re.escape(text)


def _krylov(method, A=A, x0=X0, d=3, **kwargs):
    return krylovjax.krylov(A, x0, d, method=method, **kwargs)


def _krylov_unchecked(method, A=A, x0=X0, d=3, **kwargs):
    """`_krylov` for arguments outside `krylov`'s annotations."""
    return unchecked(krylovjax.krylov)(A, x0, d, method=method, **kwargs)


# ----------------------------------------------------------------- krylov: A, x0


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(3, 4), (3,), (3, 3, 3)])
def test_krylov_non_square_matrix(method, shape):
    bad = jnp.ones(shape)
    with pytest.raises(ValueError, match=_m("`krylov(A=...)` must be a square matrix")):
        _krylov_unchecked(method, A=bad)


@pytest.mark.parametrize("method", METHODS)
def test_krylov_non_square_bcoo(method):
    bad = sparse.BCOO.fromdense(jnp.ones((3, 4)))
    with pytest.raises(ValueError, match=_m("got shape (3, 4)")):
        _krylov_unchecked(method, A=bad)


@pytest.mark.parametrize("method", METHODS)
def test_krylov_batched_bcoo(method):
    bad = sparse.BCOO.fromdense(jnp.ones((3, 3)), n_dense=1)
    with pytest.raises(ValueError, match=_m("n_batch=0 and n_dense=0")):
        _krylov(method, A=bad)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(4,), (2, 3)])
def test_krylov_x0_first_axis_mismatch(method, shape):
    msg = f"`krylov(x0=...)` must have first axis of length 3 to match `A` of shape (3, 3); got shape {shape}"  # noqa: E501
    with pytest.raises(ValueError, match=_m(msg)):
        _krylov_unchecked(method, x0=jnp.ones(shape))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("matrix", ["dense", "bcoo"])
def test_krylov_x0_too_many_axes_for_matrix(method, matrix):
    M = A if matrix == "dense" else sparse.BCOO.fromdense(A)
    with pytest.raises(ValueError, match=_m("must have shape (n,) or (n, b)")):
        _krylov(method, A=M, x0=jnp.ones((3, 2, 2)))


@pytest.mark.parametrize("method", METHODS)
def test_krylov_scalar_x0(method):
    with pytest.raises(ValueError, match=_m("`krylov(x0=...)` must have at least one")):
        _krylov_unchecked(method, A=lambda x: x, x0=jnp.array(1.0))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    ("which", "value"),
    [
        ("A", jnp.eye(3, dtype=jnp.int32)),
        ("A", np.eye(3, dtype=bool)),
        ("A", sparse.BCOO.fromdense(jnp.eye(3, dtype=jnp.int32))),
        ("x0", jnp.ones(3, jnp.int32)),
        ("x0", np.ones(3, bool)),
    ],
)
def test_krylov_integer_and_bool_arrays(method, which, value):
    msg = f"`krylov({which}=...)` must have a floating-point or complex dtype"
    with pytest.raises(TypeError, match=_m(msg)):
        _krylov_unchecked(method, **{which: value})


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bad", ["not an operator", None, 3.0])
def test_krylov_operator_of_wrong_type(method, bad):
    with pytest.raises(TypeError, match=_m("`krylov(A=...)` must be a square array")):
        _krylov_unchecked(method, A=bad)


@pytest.mark.parametrize("method", METHODS)
def test_krylov_x0_not_an_array(method):
    with pytest.raises(TypeError, match=_m("`krylov(x0=...)` must be an array")):
        _krylov_unchecked(method, x0=[1.0, 2.0, 3.0])


# ------------------------------------------------------------ krylov: callables


@pytest.mark.parametrize("method", METHODS)
def test_krylov_callable_changes_shape(method):
    with pytest.raises(ValueError, match=_m("same shape as `x0`, (3,); it returned")):
        _krylov(method, A=lambda x: jnp.concatenate([x, x]))


@pytest.mark.parametrize("method", METHODS)
def test_krylov_callable_changes_dtype(method):
    with pytest.raises(TypeError, match=_m("same dtype as `x0`, float32")):
        _krylov(method, A=lambda x: x.astype(jnp.float64), x0=jnp.ones(3, jnp.float32))


@pytest.mark.parametrize("method", METHODS)
def test_krylov_callable_returns_pytree(method):
    with pytest.raises(TypeError, match=_m("returns one array")):
        _krylov(method, A=lambda x: (x, x))


# -------------------------------------------------------------------- krylov: d


@pytest.mark.parametrize("fn", ["krylov", "iterate"])
@pytest.mark.parametrize("d", [0, -2])
def test_depth_not_positive(fn, d):
    with pytest.raises(ValueError, match=_m(f"`{fn}(d=...)` must be an int >= 1")):
        _call(fn, d)


@pytest.mark.parametrize("fn", ["krylov", "iterate"])
@pytest.mark.parametrize("d", [3.0, "3", None, jnp.array([3])])
def test_depth_not_an_int(fn, d):
    with pytest.raises(TypeError, match=_m(f"`{fn}(d=...)` must be a Python int")):
        _call(fn, d, wrap=unchecked)


@pytest.mark.parametrize("fn", ["krylov", "iterate"])
def test_depth_bool(fn):
    # Within the annotation (`bool` is a subclass of `int`), but not a count.
    with pytest.raises(TypeError, match=_m(f"`{fn}(d=...)` must be a Python int")):
        _call(fn, True)


@pytest.mark.parametrize("fn", ["krylov", "iterate"])
def test_depth_traced(fn):
    with pytest.raises(TypeError, match=_m("got a traced value")):
        jax.jit(lambda d: _call(fn, d))(3)


@pytest.mark.parametrize("fn", ["krylov", "iterate"])
@pytest.mark.parametrize("d", [np.int64(3), jnp.array(3)])
def test_depth_integer_scalars_accepted(fn, d):
    assert _call(fn, d).shape == (3, 3)


def _call(fn, d, wrap=lambda f: f):
    if fn == "krylov":
        return wrap(krylovjax.krylov)(A, X0, d, method=METHODS[0])
    return wrap(krylovjax.iterate)(jnp.sin, X0, d)


# -------------------------------------------------------------- krylov: options


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    ("option", "value"),
    [("layout", "cols"), ("layout", None), ("adjoint", "reverse"), ("adjoint", True)],
)
def test_krylov_unknown_option(method, option, value):
    with pytest.raises(ValueError, match=_m(f"`krylov({option}=...)` must be one of")):
        _krylov_unchecked(method, **{option: value})


@pytest.mark.parametrize("kind", MATRIX_KINDS)
def test_krylov_doubling_with_custom_jvp(kind):
    params, build = make_operator(kind, A)
    msg = "`krylov(adjoint='custom_jvp')` is not available with `method='doubling'`"
    with pytest.raises(ValueError, match=_m(msg)):
        _krylov("doubling", A=build(params), adjoint="custom_jvp")


@pytest.mark.parametrize("value", ["lanczos", "SCAN", None])
def test_krylov_unknown_method(value):
    with pytest.raises(ValueError, match=_m("`krylov(method=...)` must be one of")):
        unchecked(krylovjax.krylov)(A, X0, 3, method=value)


# ---------------------------------------------------------------------- iterate


@pytest.mark.parametrize(
    "x0",
    [
        jnp.ones(3, jnp.int32),
        {"a": jnp.ones(3), "b": jnp.ones(2, bool)},
        (jnp.ones(3), np.arange(3)),
    ],
)
def test_iterate_integer_state_leaf(x0):
    msg = "`iterate(x0=...)` must have a floating-point or complex dtype"
    with pytest.raises(TypeError, match=_m(msg)):
        krylovjax.iterate(lambda s: s, x0, 3)


@pytest.mark.parametrize("x0", [(), {}, None])
def test_iterate_empty_state(x0):
    with pytest.raises(ValueError, match=_m("`iterate(x0=...)` must hold at least")):
        krylovjax.iterate(lambda s: s, x0, 3)


def test_iterate_state_leaf_not_an_array():
    with pytest.raises(TypeError, match=_m("`iterate(x0=...)` must be an array")):
        krylovjax.iterate(lambda s: s, {"a": jnp.ones(2), "b": "text"}, 3)


def test_iterate_step_not_callable():
    with pytest.raises(TypeError, match=_m("`iterate(step=...)` must be callable")):
        unchecked(krylovjax.iterate)(jnp.ones(3), X0, 3)


@pytest.mark.parametrize(
    "step",
    [
        lambda s: {"a": s["a"]},
        lambda s: (s["a"], s["b"]),
        lambda s: {"a": s["a"], "b": s["b"], "c": s["a"]},
    ],
)
def test_iterate_step_changes_structure(step):
    x0 = {"a": jnp.ones(3), "b": jnp.ones(2)}
    with pytest.raises(TypeError, match=_m("must return a pytree with the structure")):
        krylovjax.iterate(step, x0, 3)


def test_iterate_step_changes_shape():
    x0 = {"a": jnp.ones(3), "b": jnp.ones(2)}
    step = lambda s: {"a": s["a"], "b": s["b"][:1]}  # noqa: E731
    msg = "must return arrays of the same shapes as `x0`; expected shape (2,), got (1,)"
    with pytest.raises(ValueError, match=_m(msg)):
        krylovjax.iterate(step, x0, 3)


def test_iterate_step_changes_dtype():
    x0 = (jnp.ones(3, jnp.float32), jnp.ones(2, jnp.float32))
    step = lambda s: (s[0], s[1].astype(jnp.complex64))  # noqa: E731
    msg = (
        "must return arrays of the same dtypes as `x0`; expected dtype float32, got "
        "complex64 for the leaf `x0[1]`."
    )
    with pytest.raises(TypeError, match=_m(msg)):
        krylovjax.iterate(step, x0, 3)


@pytest.mark.parametrize("value", ["reverse", "custom", None])
def test_iterate_unknown_adjoint(value):
    with pytest.raises(ValueError, match=_m("`iterate(adjoint=...)` must be one of")):
        unchecked(krylovjax.iterate)(jnp.sin, X0, 3, adjoint=value)
