r"""Tangent maps with a hand-written transpose: forward and reverse mode from one rule.

A `jax.custom_vjp` cannot be differentiated in forward mode, and JAX's own
transposition of a `jax.custom_jvp` rule saves what the rule computes per step. The
default rules of `krylov` and `iterate` are therefore `custom_jvp` rules whose tangent
output comes from a *tangent primitive*: a JAX primitive, linear in its tangent
arguments, whose

- implementation is a tangent scan (what `jax.jvp` and `jax.jacfwd` run);
- transpose rule is the library's hand-written reverse pass (what `jax.grad` and
  `jax.vjp` run after linearising the JVP rule), with the forward output as the only
  residual;
- JVP rule differentiates the implementation with JAX's own rules (second
  derivatives);
- batching rule is the implementation, vmapped: `vmap` of `grad` keeps the
  hand-written reverse pass for every batch member, while `grad` of a vmapped call
  transposes the tangent scan with JAX's rules (correct, with more memory).

`tangent_primitive(name, impl, transpose, like)` builds one from two functions of
pytrees (`equinox.internal`'s filtered primitives, as lineax's `linear_solve` uses):
`impl(*args) -> out`, and `transpose(args, ct) -> cts`, which returns a cotangent for
every argument that `is_tangent` (an undefined primal) and `None` elsewhere.
"""

import functools as ft
from collections.abc import Callable
from typing import Any

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.extend.core
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.core import ShapedArray
from jax.interpreters import ad, batching, mlir


def _is_undefined(x) -> bool:
    return isinstance(x, ad.UndefinedPrimal)


def is_tangent(tree) -> bool:
    """Whether the transpose rule must return a cotangent for `tree`."""
    return any(_is_undefined(x) for x in jtu.tree_leaves(tree, is_leaf=_is_undefined))


def nones(tree):
    """No cotangent for any leaf of `tree`."""
    return jtu.tree_map(lambda _: None, tree, is_leaf=_is_undefined)


def like_tangent(tangent, ct):
    """`ct` with `None` wherever the tangent argument `tangent` has no leaf."""
    return jtu.tree_map(
        lambda t, c: None if t is None else c,
        tangent,
        ct,
        is_leaf=lambda x: x is None or _is_undefined(x),
    )


def _zeros_like_inexact(tree):
    return jtu.tree_map(
        lambda x: jnp.zeros_like(x) if eqx.is_inexact_array(x) else None, tree
    )


class _NotRebound(Exception):
    """The `batch` hook declined: vmap the implementation instead."""


def tangent_primitive(
    name: str,
    impl: Callable,
    transpose: Callable,
    like: int,
    batch: Callable | None = None,
) -> Callable[..., Any]:
    """A tangent primitive, returned as a function of pytrees that binds it.

    Its output has the structure, shapes, dtypes and shardings of argument number
    `like` (the stored trajectory whose tangents it computes). Under `vmap`,
    `batch(bind, args, batch_axes)` may return `(out, out_axis)` from a call of the
    primitive itself on batched arguments, so that `grad` of a vmapped function
    still transposes with `transpose`; where it returns `None` (or is not given)
    the implementation is vmapped instead.
    """

    def impl_flat(*args):
        return (impl(*args),)

    def abstract_eval(*args):
        return (
            jtu.tree_map(
                lambda s: ShapedArray(s.shape, s.dtype, sharding=s.sharding),
                args[like],
            ),
        )

    def jvp(primals, tangents):
        tangents = tuple(
            _zeros_like_inexact(p) if t is None else t
            for p, t in zip(primals, tangents, strict=True)
        )
        return eqx.filter_jvp(impl_flat, tuple(primals), tangents)

    def transpose_rule(inputs, cts_out):
        (ct,) = cts_out
        return transpose(inputs, ct)

    prim_impl = eqxi.filter_primitive_def(impl_flat)
    prim = jax.extend.core.Primitive(name)
    prim.multiple_results = True
    prim.def_impl(prim_impl)
    prim.def_abstract_eval(eqxi.filter_primitive_def(abstract_eval))
    ad.primitive_jvps[prim] = eqxi.filter_primitive_jvp(jvp)
    ad.primitive_transposes[prim] = eqxi.filter_primitive_transpose(
        transpose_rule, materialise_zeros=True
    )

    def bind(*args):
        (out,) = eqxi.filter_primitive_bind(prim, *args)
        return out

    def rebind(inputs, batch_axes):
        rebound = batch(bind, inputs, batch_axes)  # pyright: ignore[reportOptionalCall]
        if rebound is None:
            raise _NotRebound
        out, axis = rebound
        return (out,), (jtu.tree_map(lambda _: axis, out),)

    def batch_rule(args, dims, **params):
        if batch is not None:
            try:
                return eqxi.filter_primitive_batching(rebind)(args, dims, **params)
            except _NotRebound:
                pass
        outs = jax.vmap(ft.partial(prim_impl, **params), in_axes=dims)(*args)
        return outs, [0] * len(outs)

    batching.primitive_batchers[prim] = batch_rule
    mlir.register_lowering(prim, mlir.lower_fun(prim_impl, multiple_results=True))
    return bind
