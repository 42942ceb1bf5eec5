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
- batching rule binds the primitive again: on the batch folded into each vector
  (the `batch` hook, e.g. a batch of starting vectors for one operator), or else
  a second primitive whose implementation and transpose rule are the first's,
  vmapped (a batch of operators). So `grad` of a vmapped call also runs the
  hand-written reverse pass, never JAX's transposition of the tangent scan (which
  jax 0.7-0.9 cannot do for a vmapped scan).

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


def coefficient_cotangents(t_coefficients, ct_coefficients):
    """The basis coefficients' cotangents `(a, b, c)` where their tangent
    arguments `t_coefficients` are tangents, `None` elsewhere (all `None`
    without coefficients or without their cotangents)."""
    if ct_coefficients is None or t_coefficients is None:
        return nones(t_coefficients)
    return tuple(
        ct if is_tangent(t) else None
        for t, ct in zip(t_coefficients, ct_coefficients, strict=True)
    )


def _zeros_like_inexact(tree):
    return jtu.tree_map(
        lambda x: jnp.zeros_like(x) if eqx.is_inexact_array(x) else None, tree
    )


class _NotRebound(Exception):
    """The `batch` hook declined: bind the vmapped primitive instead."""


def _vmap_over(fn, inputs, axes, out_axes=0):
    """`fn(*inputs)` vmapped over the array leaves of `inputs` along `axes` (a tree
    like `inputs`, `None` where a leaf is not batched or not an array).

    Leaf by leaf, so that containers whose leaves vmap cannot match against a tree
    of axes (a BCOO matrix inside an operator) need no special case."""
    leaves, treedef = jtu.tree_flatten(inputs)
    leaf_axes = treedef.flatten_up_to(axes)
    arrays = [i for i, x in enumerate(leaves) if eqx.is_array(x)]

    def one(values):
        full = list(leaves)
        for i, v in zip(arrays, values, strict=True):
            full[i] = v
        return fn(*treedef.unflatten(full))

    values = [leaves[i] for i in arrays]
    in_axes = ([leaf_axes[i] for i in arrays],)
    return jax.vmap(one, in_axes=in_axes, out_axes=out_axes)(values)


def _unbatched(x, axis):
    """An undefined primal with its batch axis removed."""
    if not _is_undefined(x) or axis is None:
        return x
    shape = x.aval.shape[:axis] + x.aval.shape[axis + 1 :]
    return ad.UndefinedPrimal(ShapedArray(shape, x.aval.dtype))


def _to_axis(ct, x, axis):
    """A cotangent computed with the batch first, for an input batched on `axis`
    (summed over the batch if the input was not batched)."""
    if ct is None or not _is_undefined(x):
        return ct
    return jnp.sum(ct, 0) if axis is None else jnp.moveaxis(ct, 0, axis)


def _define(name: str, impl: Callable, abstract_eval: Callable, transpose: Callable):
    """A primitive on pytrees from its implementation, abstract evaluation and
    transpose rule; its JVP rule differentiates the implementation. Returns the
    primitive and its flat implementation (for a batching rule)."""

    def jvp(primals, tangents):
        tangents = tuple(
            _zeros_like_inexact(p) if t is None else t
            for p, t in zip(primals, tangents, strict=True)
        )
        return eqx.filter_jvp(impl, tuple(primals), tangents)

    prim_impl = eqxi.filter_primitive_def(impl)
    prim = jax.extend.core.Primitive(name)
    prim.multiple_results = True
    prim.def_impl(prim_impl)
    prim.def_abstract_eval(eqxi.filter_primitive_def(abstract_eval))
    ad.primitive_jvps[prim] = eqxi.filter_primitive_jvp(jvp)
    ad.primitive_transposes[prim] = eqxi.filter_primitive_transpose(
        transpose, materialise_zeros=True
    )
    mlir.register_lowering(prim, mlir.lower_fun(prim_impl, multiple_results=True))
    return prim, prim_impl


def tangent_primitive(
    name: str,
    impl: Callable,
    transpose: Callable,
    like: int,
    batch: Callable | None = None,
    extra_rows: int = 0,
) -> Callable[..., Any]:
    """A tangent primitive, returned as a function of pytrees that binds it.

    Its output has the structure, shapes, dtypes and shardings of argument number
    `like` (the stored trajectory whose tangents it computes), with `extra_rows`
    more entries along the first axis of each leaf (a trajectory whose last
    vector is not stored). Under `vmap`,
    `batch(bind, args, batch_axes)` may return `(out, out_axis)` from a call of the
    primitive itself on batched arguments; where it returns `None` (or is not
    given), a second primitive is bound, whose implementation and transpose are
    `impl` and `transpose` vmapped. Either way `grad` of a vmapped function
    transposes with `transpose`, never by JAX's transposition of the tangent scan.
    """

    def impl_flat(*args):
        return (impl(*args),)

    def grown(shape):
        return (shape[0] + extra_rows, *shape[1:]) if extra_rows else tuple(shape)

    def abstract_eval(*args):
        return (
            jtu.tree_map(
                lambda s: ShapedArray(grown(s.shape), s.dtype, sharding=s.sharding),
                args[like],
            ),
        )

    def transpose_rule(inputs, cts_out):
        (ct,) = cts_out
        return transpose(inputs, ct)

    # The vmapped primitive: arguments `(args, axes)`, the output batched first.
    def impl_vmapped(args, axes):
        return (_vmap_over(impl, args, axes),)

    def abstract_eval_vmapped(args, axes):
        # Like argument `like`, with the batch axis first.
        sizes = []
        jtu.tree_map(
            lambda a, x: a is None or sizes.append(x.shape[a]),
            axes,
            args,
            is_leaf=lambda a: a is None,
        )
        size = sizes[0]

        def batched(axis, s):
            shape = list(s.shape)
            batch = size if axis is None else shape.pop(axis)
            return ShapedArray((batch, *grown(shape)), s.dtype)

        return (
            jtu.tree_map(batched, axes[like], args[like], is_leaf=lambda a: a is None),
        )

    def transpose_vmapped(inputs, cts_out):
        (ct,) = cts_out
        args, axes = inputs
        # Leaf by leaf: the arrays are vmapped along their axes; the undefined
        # primals (what cotangents are wanted for) and Python values stay outside,
        # the former without their batch axis.
        leaves, treedef = jtu.tree_flatten(args, is_leaf=_is_undefined)
        leaf_axes = treedef.flatten_up_to(axes)
        arrays = [i for i, x in enumerate(leaves) if eqx.is_array(x)]
        wanted = [i for i, x in enumerate(leaves) if _is_undefined(x)]
        fixed = list(leaves)
        for i in wanted:
            fixed[i] = _unbatched(leaves[i], leaf_axes[i])

        def one(values, ct):
            full = list(fixed)
            for i, v in zip(arrays, values, strict=True):
                full[i] = v
            cts = treedef.flatten_up_to(transpose(treedef.unflatten(full), ct))
            return [cts[i] for i in wanted]

        values = [leaves[i] for i in arrays]
        in_axes = ([leaf_axes[i] for i in arrays], 0)
        cts_wanted = jax.vmap(one, in_axes=in_axes)(values, ct)
        cts: list = [None] * len(leaves)
        for i, c in zip(wanted, cts_wanted, strict=True):
            cts[i] = _to_axis(c, leaves[i], leaf_axes[i])
        return treedef.unflatten(cts), nones(axes)

    prim, _ = _define(name, impl_flat, abstract_eval, transpose_rule)
    prim_vmapped, vmapped_impl = _define(
        f"{name}_vmapped", impl_vmapped, abstract_eval_vmapped, transpose_vmapped
    )

    def batch_vmapped(args, dims, **params):
        # vmap of vmap (rare): the implementation, vmapped once more.
        outs = jax.vmap(ft.partial(vmapped_impl, **params), in_axes=dims)(*args)
        return outs, [0] * len(outs)

    batching.primitive_batchers[prim_vmapped] = batch_vmapped

    def bind(*args):
        (out,) = eqxi.filter_primitive_bind(prim, *args)
        return out

    def rebind(inputs, batch_axes):
        rebound = None if batch is None else batch(bind, inputs, batch_axes)
        if rebound is None:
            (out,) = eqxi.filter_primitive_bind(prim_vmapped, inputs, batch_axes)
            return (out,), (jtu.tree_map(lambda _: 0, out),)
        out, axis = rebound
        return (out,), (jtu.tree_map(lambda _: axis, out),)

    def batch_rule(args, dims, **params):
        return eqxi.filter_primitive_batching(rebind)(args, dims, **params)

    batching.primitive_batchers[prim] = batch_rule
    return bind
