"""Trace-time check that a callable `A` is linear in its input.

`krylov` treats a callable `A` as a linear operator: its transpose is the VJP at
zero, and its tangent map applies `A` to tangents. A nonlinear or affine map would
give silently wrong derivatives, so `as_operator` rejects it by reading the
callable's jaxpr (nothing is executed): `check_linear` raises a `TypeError` naming
the argument and pointing to `krylovjax.iterate`.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array


def check_linear(fn: Callable[..., Any], x: Array, arg: str) -> None:
    """Raise a `TypeError` unless `fn` is linear in `x`, its own arrays held fixed.

    Both checks read the jaxpr of `fn` at trace time; nothing is executed. First, JAX
    must be able to transpose `fn` with respect to `x` (`jax.linear_transpose`),
    which fails on any nonlinear primitive: `sin`, `x * x`, a comparison of `x`. It
    also fails on a `jax.custom_vjp` function and on an `equinox.error_if` that
    tests `x`, linear as they may be, so a failure is only final if the VJP of `fn`
    reads `x` too (`_pullback_reads_x`); a linear map's does not. (A map whose
    derivative JAX takes to be zero, such as `jnp.round`, passes that test.)
    Transposition ignores a term that does not depend on `x`, so an affine map
    `x -> M @ x + c` passes; second, therefore, `fn(0)` must be zero by the structure
    of the jaxpr (`_at_zero`): nothing that is not zero may be added to a term in `x`.
    A term added inside a primitive that the second check does not know (a custom
    primitive, `custom_linear_solve`) goes unnoticed.
    """
    dynamic, static = eqx.partition(fn, eqx.is_array)
    leaves, treedef = jtu.tree_flatten(dynamic)

    def apply(leaves, x):
        return eqx.combine(jtu.tree_unflatten(treedef, leaves), static)(x)

    closed = jax.make_jaxpr(apply)(leaves, x)
    run = jex.jaxpr_as_fun(closed)

    def transpose(leaves, x):
        def linear(x):
            return run(*leaves, x)[0]

        return jax.linear_transpose(linear, x)(linear(x))

    try:
        jax.eval_shape(transpose, leaves, x)
    except Exception as err:
        if not _pullback_reads_x(run, leaves, x):
            return _check_zero_at_zero(closed, len(leaves), arg)
        # A missing transpose rule names the primitive; other failures say little.
        lines = str(err).splitlines() if isinstance(err, NotImplementedError) else []
        reason = f" ({lines[0]})" if lines else ""
        msg = (
            f"`{arg}` must be linear in its input; got a callable that JAX cannot "
            f"transpose{reason}. A nonlinear map belongs in `krylovjax.iterate`."
        )
        raise TypeError(msg) from err
    return _check_zero_at_zero(closed, len(leaves), arg)


def _pullback_reads_x(run: Callable, leaves: list[Any], x: Array) -> bool:
    """Whether the VJP of `x -> run(*leaves, x)` reads `x` (a nonlinear map's does)."""

    def pullback(leaves, x, ct):
        _, vjp = jax.vjp(lambda x: run(*leaves, x)[0], x)
        return vjp(ct)

    try:
        ct = jax.eval_shape(run, *leaves, x)[0]
        closed = jax.make_jaxpr(pullback)(leaves, x, ct)
    except Exception:  # not even differentiable in reverse mode
        return True
    return _live_inputs(closed.jaxpr, [True] * len(closed.jaxpr.outvars))[len(leaves)]


def _live_inputs(jaxpr: jex.Jaxpr, live_out: Sequence[bool]) -> list[bool]:
    """Which inputs of `jaxpr` its live outputs read (dead-code analysis)."""
    live = {
        v
        for v, keep in zip(jaxpr.outvars, live_out, strict=True)
        if keep and isinstance(v, jex.Var)
    }
    for eqn in reversed(jaxpr.eqns):
        outs = [v in live for v in eqn.outvars]
        if not any(outs):
            continue
        sub = _call_jaxpr(eqn)
        if sub is None:
            ins = [True] * len(eqn.invars)
        else:
            open_ = sub.jaxpr if isinstance(sub, jex.ClosedJaxpr) else sub
            ins = _live_inputs(open_, outs)
        live.update(
            v
            for v, keep in zip(eqn.invars, ins, strict=True)
            if keep and isinstance(v, jex.Var)
        )
    return [v in live for v in jaxpr.invars]


def _call_jaxpr(eqn: jex.JaxprEqn) -> jex.ClosedJaxpr | jex.Jaxpr | None:
    """The jaxpr that `eqn` calls on its arguments as they are (`jit`, `remat`)."""
    if eqn.primitive.name in ("scan", "while", "cond"):
        return None
    for key in ("jaxpr", "call_jaxpr"):
        sub = eqn.params.get(key)
        open_ = sub.jaxpr if isinstance(sub, jex.ClosedJaxpr) else sub
        if (
            isinstance(open_, jex.Jaxpr)
            and len(open_.invars) == len(eqn.invars)
            and len(open_.outvars) == len(eqn.outvars)
        ):
            return sub
    return None


def _check_zero_at_zero(closed: jex.ClosedJaxpr, n_leaves: int, arg: str) -> None:
    in_flags = [(False, True)] * n_leaves + [(True, False)]
    consts = [_const_flag(c) for c in closed.consts]
    if any(nonzero for _, nonzero in _at_zero(closed.jaxpr, consts, in_flags)):
        msg = (
            f"`{arg}` must be linear in its input, so that A(0) = 0; got a callable "
            f"that adds a term that does not depend on its input (an affine map such "
            f"as `lambda x: M @ x + c`, or a constant). Such a map belongs in "
            f"`krylovjax.iterate`. A JAX array that the callable closes over and "
            f"puts in its output counts as such a term even if it holds zeros (a "
            f"padding or `jnp.where` fill made outside it): make those zeros inside "
            f"the callable, e.g. `jnp.zeros_like(x[:1])` or the literal `0.0`."
        )
        raise TypeError(msg)


# The structure of `fn(0)`, one flag pair per variable of the jaxpr: (depends on x,
# may be nonzero at x = 0). A primitive that JAX can transpose is linear in the
# arguments that depend on x, so at x = 0 it is zero, except where another argument
# is added rather than multiplied: these primitives.
_ADDITIVE = frozenset(
    {
        "add",
        "add_any",
        "sub",
        "complex",
        "concatenate",
        "pad",
        "select_n",
        "dynamic_update_slice",
        "scatter",
        "scatter-add",
        "scatter-sub",
    }
)
# Primitives that map zero arguments to zero, for terms that do not depend on x
# (`jnp.zeros(...)` is a broadcast of a literal 0.0).
_ZERO_PRESERVING = _ADDITIVE | {
    "broadcast_in_dim",
    "convert_element_type",
    "copy",
    "copy_p",
    "reshape",
    "squeeze",
    "expand_dims",
    "transpose",
    "slice",
    "dynamic_slice",
    "gather",
    "neg",
    "mul",
    "dot_general",
    "reduce_sum",
    "real",
    "imag",
    "conj",
}

_Flag = tuple[bool, bool]


def _const_flag(value: Any) -> _Flag:
    # A NumPy constant is read; any other array is taken to be nonzero.
    if isinstance(value, np.ndarray | np.generic | int | float | complex):
        return False, bool(np.any(np.asarray(value) != 0))
    return False, True


def _at_zero(
    jaxpr: jex.Jaxpr, const_flags: Sequence[_Flag], in_flags: Sequence[_Flag]
) -> list[_Flag]:
    env = dict(zip(jaxpr.constvars, const_flags, strict=True))
    env.update(zip(jaxpr.invars, in_flags, strict=True))

    def read(v):
        if isinstance(v, jex.Literal):
            return _const_flag(np.asarray(v.val))
        return env[v]

    for eqn in jaxpr.eqns:
        outs = _eqn_at_zero(eqn, [read(v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _sub_at_zero(sub: Any, in_flags: Sequence[_Flag]) -> list[_Flag]:
    if isinstance(sub, jex.ClosedJaxpr):
        consts = [_const_flag(c) for c in sub.consts]
        return _at_zero(sub.jaxpr, consts, in_flags)
    return _at_zero(sub, [(False, True)] * len(sub.constvars), in_flags)


def _calls_back(jaxpr: jex.Jaxpr) -> bool:
    return any(eqn.primitive.name == "pure_callback" for eqn in jaxpr.eqns)


def _join(a: _Flag, b: _Flag) -> _Flag:
    return a[0] or b[0], a[1] or b[1]


def _eqn_at_zero(eqn: jex.JaxprEqn, ins: list[_Flag]) -> list[_Flag]:
    name, params = eqn.primitive.name, eqn.params
    if name == "cond":
        outs = [_sub_at_zero(branch, ins[1:]) for branch in params["branches"]]
        # A branch that ignores its operands and calls back to Python raises an
        # error (`equinox.error_if`): its outputs are never used.
        kept = [
            flags
            for flags, branch in zip(outs, params["branches"], strict=True)
            if any(dep for dep, _ in flags) or not _calls_back(branch.jaxpr)
        ]
        return [functools.reduce(_join, f) for f in zip(*(kept or outs), strict=True)]
    if name == "scan":
        # The carry's flags: a fixed point, reached in at most 2 * num_carry rounds.
        n_consts, n_carry = params["num_consts"], params["num_carry"]
        carry = ins[n_consts : n_consts + n_carry]
        while True:
            rest = ins[n_consts + n_carry :]
            outs = _sub_at_zero(params["jaxpr"], ins[:n_consts] + carry + rest)
            joined = [_join(a, b) for a, b in zip(carry, outs[:n_carry], strict=True)]
            if joined == carry:
                return joined + outs[n_carry:]
            carry = joined
    sub = _call_jaxpr(eqn)
    if sub is not None:
        return _sub_at_zero(sub, ins)
    depends = any(dep for dep, _ in ins)
    if depends and name in _ADDITIVE:
        nonzero = any(
            flag[1]
            for v, flag in zip(eqn.invars, ins, strict=True)
            if jnp.issubdtype(getattr(v.aval, "dtype", np.bool_), jnp.inexact)
        )
    elif depends:
        nonzero = any(flag[1] for flag in ins if flag[0])
    else:
        nonzero = name not in _ZERO_PRESERVING or any(flag[1] for flag in ins)
    return [(depends, nonzero)] * len(eqn.outvars)
