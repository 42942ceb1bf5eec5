r"""Polynomial bases given by a three-term recurrence, for `krylov(basis=...)`.

A basis is a sequence of polynomials with $p_0 = 1$ and, for $k \ge 0$,

$$p_{k+1}(\lambda) = (a_k \lambda + b_k)\, p_k(\lambda) - c_k\, p_{k-1}(\lambda),
  \qquad c_0 = 0,$$

so that $x_k = p_k(A) x_0$ obeys $x_{k+1} = a_k A x_k + b_k x_k - c_k x_{k-1}$. A
basis only supplies $(a_k, b_k, c_k)_{k < d - 1}$, in terms of $\lambda$.

The classical families are defined on $t \in [-1, 1]$ by a recurrence
$p_{k+1}(t) = (A_k t + B_k)\, p_k(t) - C_k\, p_{k-1}(t)$. On an interval
$[\mathrm{lo}, \mathrm{hi}]$ they are composed with the affine map

$$t = s \lambda + m, \qquad s = \frac{2}{\mathrm{hi} - \mathrm{lo}}, \qquad
  m = -\frac{\mathrm{hi} + \mathrm{lo}}{\mathrm{hi} - \mathrm{lo}},$$

which gives $a_k = A_k s$, $b_k = A_k m + B_k$ and $c_k = C_k$. The recurrences
(DLMF 18.9.1 and 18.9.2) are, with $C_0 = 0$:

- Chebyshev $T_k$: $A_0 = 1$, $A_k = 2$, $B_k = 0$, $C_k = 1$;
- Chebyshev $U_k$: $A_k = 2$, $B_k = 0$, $C_k = 1$;
- Legendre $P_k$: $A_k = \frac{2k+1}{k+1}$, $B_k = 0$, $C_k = \frac{k}{k+1}$;
- Jacobi $P_k^{(\alpha,\beta)}$, for $k \ge 1$, with $\sigma = \alpha + \beta$
  and $\nu = 2k + \sigma$:

$$A_k = \frac{(\nu+1)(\nu+2)}{2(k+1)(k+\sigma+1)}, \quad
  B_k = \frac{(\nu+1)(\alpha^2-\beta^2)}{2(k+1)(k+\sigma+1)\,\nu}, \quad
  C_k = \frac{(k+\alpha)(k+\beta)(\nu+2)}{(k+1)(k+\sigma+1)\,\nu}.$$

At $k = 0$ this formula divides by zero where $\sigma = 0$ or $\sigma = -1$, so
$P_1^{(\alpha,\beta)}(t) = \frac{\sigma + 2}{2} t + \frac{\alpha - \beta}{2}$ is
used instead; for $k \ge 1$ and $\alpha, \beta > -1$ every denominator is
positive, so the coefficients and their derivatives are finite.
"""

import abc
import dataclasses
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jaxtyping import Array, ArrayLike, DTypeLike, Float, Inexact, Real

from ._checks import as_array, check_dtype, check_shape, check_size
from ._typing import StaticInt

Coefficients = tuple[Float[Array, " m"], Float[Array, " m"], Float[Array, " m"]]
RealScalar = Real[ArrayLike, ""]
RealVector = Real[ArrayLike, ""] | Real[ArrayLike, " _"]


def real_scalar(value: Any, arg: str, *, rank: int = 0) -> Array:
    """`value` (a Python number or a real floating-point array of rank at most
    `rank`) as a JAX array; a `TypeError` or `ValueError` naming `arg` otherwise.
    A Python `int` becomes a floating-point array."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, float | complex):
        value = np.asarray(value)
    x = as_array(value, arg)
    if jnp.iscomplexobj(x):
        msg = f"`{arg}` must be real; got dtype {x.dtype}."
        raise TypeError(msg)
    if rank == 0:
        check_shape(x, (), arg, "(a scalar)")
    elif x.ndim > rank:
        msg = f"`{arg}` must be a scalar or a vector; got shape {x.shape}."
        raise ValueError(msg)
    return x


def _set(basis: Any, **values: Any) -> None:
    """In `__init__`: each of `values` converted by `real_scalar` into a field."""
    for field, value in values.items():
        rank = 1 if isinstance(basis, ThreeTerm) else 0
        arg = f"{type(basis).__name__}({field}=...)"
        setattr(basis, field, real_scalar(value, arg, rank=rank))
    _check_values(basis)


def _check_values(basis: Any, dtype: Any = None) -> None:
    """Raise a `ValueError` naming the argument if a concrete array field of
    `basis` is not finite, if `lo >= hi`, or if `alpha` or `beta` is `<= -1`;
    with `dtype`, the fields rounded to `dtype`, the precision the coefficients
    are computed in (`Jacobi(-1 + 1e-9, ...)` is valid in float64, but its
    `alpha` is -1 in float32). Traced fields (under `jax.jit`, say) are not
    checked."""
    name = type(basis).__name__
    given = {
        field.name: np.asarray(getattr(basis, field.name))
        for field in dataclasses.fields(basis)
        if not field.metadata.get("static")
        and not isinstance(getattr(basis, field.name), Tracer)
    }
    values, where = given, ""
    if dtype is not None:
        with np.errstate(over="ignore"):
            values = {field: value.astype(dtype) for field, value in given.items()}
        where = f" in {np.dtype(dtype).name}, the precision of the computation"

    def got(field: str) -> str:
        if np.array_equal(values[field], given[field], equal_nan=True):
            return f"{values[field]}"
        return f"{values[field]} (rounded from {given[field]})"

    for field, value in values.items():
        if not np.all(np.isfinite(value)):
            msg = f"`{name}({field}=...)` must be finite{where}; got {got(field)}."
            raise ValueError(msg)
        if field in ("alpha", "beta") and not value > -1:
            msg = f"`{name}({field}=...)` must be > -1{where}; got {got(field)}."
            raise ValueError(msg)
    if "lo" in values and "hi" in values and not values["lo"] < values["hi"]:
        msg = (
            f"`{name}(lo=..., hi=...)` must have lo < hi{where}; got "
            f"lo={got('lo')}, hi={got('hi')}."
        )
        raise ValueError(msg)


def _check_request(basis: "AbstractBasis", d: Any, dtype: Any) -> tuple[int, Any]:
    """`(d, dtype)` of `basis.coefficients` checked, and the fields of `basis`."""
    name = f"{type(basis).__name__}.coefficients"
    d = check_size(d, f"{name}(d=...)", what="the number of polynomials")
    dtype = check_dtype(dtype, f"{name}(dtype=...)", allow_complex=False)
    _check_values(basis)
    _check_values(basis, dtype)
    return d, dtype


def _on_interval(basis: Any, A: Array, B: Array, C: Array) -> Coefficients:
    """The coefficients in $\\lambda$ of a recurrence in $t = s \\lambda + m$ on
    `[basis.lo, basis.hi]`."""
    lo, hi = basis.lo.astype(A.dtype), basis.hi.astype(A.dtype)
    s = 2 / (hi - lo)
    m = -(hi + lo) / (hi - lo)
    return A * s, A * m + B, C


def basis_coefficients(
    basis: "AbstractBasis", d: int, dtype: Any, fn_name: str
) -> tuple[Inexact[Array, " m"], Inexact[Array, " m"], Inexact[Array, " m"]]:
    """`basis.coefficients(d, ...)` for vectors of `dtype`, checked: computed in
    `dtype`'s real dtype (at least float32) and cast to `dtype` (the cast's
    derivative takes the real part for a complex `dtype`)."""
    if not isinstance(basis, AbstractBasis):
        msg = (
            f"`{fn_name}(basis=...)` must be `None` or a basis such as "
            f"`krylovjax.Chebyshev(lo, hi)`; got an object of type "
            f"{type(basis).__name__}."
        )
        raise TypeError(msg)
    real = jnp.finfo(dtype).dtype
    if real.itemsize < 4:
        real = jnp.dtype(jnp.float32)
    coefficients = basis.coefficients(d, real)
    shapes = [getattr(coef, "shape", None) for coef in coefficients]
    if len(coefficients) != 3 or any(shape != (d - 1,) for shape in shapes):
        msg = (
            f"`{fn_name}(basis=...)`: `{type(basis).__name__}.coefficients({d}, ...)` "
            f"must return three arrays (a, b, c) of shape ({d - 1},); got shapes "
            f"{shapes}."
        )
        raise ValueError(msg)
    a, b, c = (jnp.asarray(coef).astype(dtype) for coef in coefficients)
    return a, b, c


class AbstractBasis(eqx.Module):
    r"""A polynomial basis $p_0 = 1, p_1, \dots$ given by its three-term recurrence
    $p_{k+1}(\lambda) = (a_k \lambda + b_k)\, p_k(\lambda) - c_k\, p_{k-1}(\lambda)$,
    $c_0 = 0$.

    To add a basis, subclass it and write one method, `coefficients(d, dtype)`,
    returning the arrays $(a, b, c)$ of shape `(d - 1,)` (shape `(0,)` for
    `d = 1`) in the real floating-point `dtype`, with `c[0] == 0`. Any parameters
    are fields of the module: arrays among them get gradients.

    !!! Example

        ```python
        >>> import jax.numpy as jnp
        >>> import krylovjax
        >>> class Monomials(krylovjax.AbstractBasis):
        ...     # p_k = lambda^k: a_k = 1, b_k = c_k = 0.
        ...     def coefficients(self, d, dtype):
        ...         a = jnp.ones((d - 1,), dtype)
        ...         return a, jnp.zeros_like(a), jnp.zeros_like(a)
        >>> Monomials().coefficients(3, jnp.float32)
        (Array([1., 1.], dtype=float32), Array([0., 0.], dtype=float32),
         Array([0., 0.], dtype=float32))

        ```
    """

    @abc.abstractmethod
    def coefficients(self, d: StaticInt, dtype: DTypeLike) -> Coefficients:
        """**Arguments:** `d`, the number of polynomials $p_0, \\dots, p_{d-1}$
        (a static int $\\ge 1$), and a real floating-point `dtype`.

        **Returns:** $(a, b, c)$, three arrays of shape `(d - 1,)` and dtype
        `dtype`, with `c[0] == 0`.
        """


class Chebyshev(AbstractBasis):
    r"""Chebyshev polynomials $p_k(\lambda) = T_k(t)$ (`kind=1`) or $U_k(t)$
    (`kind=2`) of $t = (2\lambda - \mathrm{hi} - \mathrm{lo}) / (\mathrm{hi} -
    \mathrm{lo})$, as `scipy.special.eval_chebyt` and `eval_chebyu`: $T_1 = t$,
    $U_1 = 2t$, $p_{k+1} = 2t\, p_k - p_{k-1}$. On an interval that contains the
    spectrum of a symmetric $A$ ([`krylovjax.spectrum_interval`][]),
    $\|T_k(A)\|_2 \le 1$ for every $k$, where the powers $A^k$ grow or vanish
    geometrically.

    **Arguments:**

    - `lo`, `hi`: the interval, real scalars, `lo < hi` (default $[-1, 1]$):
        array fields, so gradients reach them (a learnable interval). Concrete
        values are checked (finite, `lo < hi`) here and in `coefficients`;
        traced ones are not.
    - `kind`: `1` (default, $T_k$) or `2` ($U_k$), static.

    !!! Example

        ```python
        >>> import jax.numpy as jnp
        >>> import krylovjax
        >>> a, b, c = krylovjax.Chebyshev(0.0, 2.0).coefficients(4, jnp.float32)
        >>> a, b, c  # t = lambda - 1: T_1 = lambda - 1, T_2 = 2 (lambda - 1) T_1 - 1
        (Array([1., 2., 2.], dtype=float32), Array([-1., -2., -2.], dtype=float32),
         Array([0., 1., 1.], dtype=float32))

        ```
    """

    lo: Real[Array, ""]
    hi: Real[Array, ""]
    kind: int = eqx.field(static=True)

    def __init__(self, lo: RealScalar = -1.0, hi: RealScalar = 1.0, kind: int = 1):
        if isinstance(kind, bool) or not isinstance(kind, int) or kind not in (1, 2):
            msg = (
                f"`Chebyshev(kind=...)` must be 1 (first kind, T_k) or 2 (second "
                f"kind, U_k); got {kind!r}."
            )
            raise ValueError(msg)
        self.kind = int(kind)
        _set(self, lo=lo, hi=hi)

    def coefficients(self, d: StaticInt, dtype: DTypeLike) -> Coefficients:
        d, dtype = _check_request(self, d, dtype)
        k = jnp.arange(d - 1)
        first = 1 if self.kind == 1 else 2
        A = jnp.where(k == 0, first, 2).astype(dtype)
        C = jnp.where(k == 0, 0, 1).astype(dtype)
        return _on_interval(self, A, jnp.zeros_like(A), C)


class Legendre(AbstractBasis):
    r"""Legendre polynomials $p_k(\lambda) = P_k(t)$, $t$ as for
    [`krylovjax.Chebyshev`][], as `scipy.special.eval_legendre`:
    $(k + 1) P_{k+1} = (2k + 1)\, t P_k - k P_{k-1}$.

    **Arguments:** `lo`, `hi`, as for [`krylovjax.Chebyshev`][].

    !!! Example

        ```python
        >>> import jax.numpy as jnp
        >>> import krylovjax
        >>> krylovjax.Legendre().coefficients(3, jnp.float32)
        (Array([1. , 1.5], dtype=float32), Array([0., 0.], dtype=float32),
         Array([0. , 0.5], dtype=float32))

        ```
    """

    lo: Real[Array, ""]
    hi: Real[Array, ""]

    def __init__(self, lo: RealScalar = -1.0, hi: RealScalar = 1.0):
        _set(self, lo=lo, hi=hi)

    def coefficients(self, d: StaticInt, dtype: DTypeLike) -> Coefficients:
        d, dtype = _check_request(self, d, dtype)
        k = jnp.arange(d - 1, dtype=dtype)
        A = (2 * k + 1) / (k + 1)
        return _on_interval(self, A, jnp.zeros_like(A), k / (k + 1))


class Jacobi(AbstractBasis):
    r"""Jacobi polynomials $p_k(\lambda) = P_k^{(\alpha, \beta)}(t)$, $t$ as for
    [`krylovjax.Chebyshev`][], as `scipy.special.eval_jacobi`: orthogonal for the
    weight $(1 - t)^\alpha (1 + t)^\beta$. $\alpha = \beta = 0$ gives Legendre's
    $P_k$, $\alpha = \beta = \mp 1/2$ multiples of $T_k$ and $U_k$. The
    recurrence (in the module docstring of `krylovjax/_bases.py`) is finite and
    exact also at $\alpha + \beta \in \{0, -1\}$, where the textbook one divides
    by zero.

    **Arguments:**

    - `alpha`, `beta`: real scalars $> -1$, array fields that gradients reach;
        concrete values are checked, traced ones are not.
    - `lo`, `hi`: as for [`krylovjax.Chebyshev`][].

    !!! Example

        ```python
        >>> import jax.numpy as jnp
        >>> import krylovjax
        >>> a, b, c = krylovjax.Jacobi(0.0, 0.0).coefficients(3, jnp.float32)
        >>> a, c  # Legendre's
        (Array([1. , 1.5], dtype=float32), Array([0. , 0.5], dtype=float32))

        ```
    """

    alpha: Real[Array, ""]
    beta: Real[Array, ""]
    lo: Real[Array, ""]
    hi: Real[Array, ""]

    def __init__(
        self,
        alpha: RealScalar,
        beta: RealScalar,
        lo: RealScalar = -1.0,
        hi: RealScalar = 1.0,
    ):
        _set(self, alpha=alpha, beta=beta, lo=lo, hi=hi)

    def coefficients(self, d: StaticInt, dtype: DTypeLike) -> Coefficients:
        d, dtype = _check_request(self, d, dtype)
        alpha, beta = self.alpha.astype(dtype), self.beta.astype(dtype)
        sigma = alpha + beta
        # k = 0: P_1 itself; k >= 1: DLMF 18.9.2, every denominator positive.
        k = jnp.arange(1, d - 1, dtype=dtype)
        nu = 2 * k + sigma
        A = (nu + 1) * (nu + 2) / (2 * (k + 1) * (k + sigma + 1))
        B = (nu + 1) * (alpha - beta) * sigma / (2 * (k + 1) * (k + sigma + 1) * nu)
        C = (k + alpha) * (k + beta) * (nu + 2) / ((k + 1) * (k + sigma + 1) * nu)
        A = jnp.concatenate([((sigma + 2) / 2)[None], A])[: d - 1]
        B = jnp.concatenate([((alpha - beta) / 2)[None], B])[: d - 1]
        C = jnp.pad(C, (1, 0))[: d - 1]
        return _on_interval(self, A, B, C)


class ThreeTerm(AbstractBasis):
    r"""A basis given by its coefficients in $\lambda$ directly:
    $p_0 = 1$, $p_{k+1}(\lambda) = (a_k \lambda + b_k)\, p_k(\lambda) - c_k\,
    p_{k-1}(\lambda)$.

    **Arguments:**

    - `a`, `b`, `c`: real scalars (one value for every step) or vectors of
        length at least $d - 1$ (later entries unused). `c[0]` is ignored (it
        multiplies $p_{-1}$): taken as 0, with zero gradient. Array fields, so
        gradients reach them; concrete entries must be finite, traced ones are
        not checked.

    !!! Example

        ```python
        >>> import jax.numpy as jnp
        >>> import krylovjax
        >>> # Chebyshev T_k on [-1, 1]: a = (1, 2, 2, ...), b = 0, c = 1.
        >>> basis = krylovjax.ThreeTerm(jnp.array([1.0, 2.0, 2.0]), 0.0, 1.0)
        >>> basis.coefficients(4, jnp.float32)
        (Array([1., 2., 2.], dtype=float32), Array([0., 0., 0.], dtype=float32),
         Array([0., 1., 1.], dtype=float32))

        ```
    """

    a: Real[Array, "..."]
    b: Real[Array, "..."]
    c: Real[Array, "..."]

    def __init__(self, a: RealVector, b: RealVector, c: RealVector):
        _set(self, a=a, b=b, c=c)

    def coefficients(self, d: StaticInt, dtype: DTypeLike) -> Coefficients:
        d, dtype = _check_request(self, d, dtype)
        a, b, c = (self._entries(name, d, dtype) for name in ("a", "b", "c"))
        c = jnp.concatenate([jnp.zeros((min(d - 1, 1),), dtype), c[1:]])
        return a, b, c

    def _entries(self, name: str, d: int, dtype: Any) -> Array:
        x = getattr(self, name)
        arg = f"ThreeTerm({name}=...)"
        if x.ndim == 0:
            return jnp.broadcast_to(x.astype(dtype), (d - 1,))
        if x.ndim != 1 or x.shape[0] < d - 1:
            msg = (
                f"`{arg}` must have at least d - 1 = {d - 1} entries for d = {d}; "
                f"got shape {x.shape}."
            )
            raise ValueError(msg)
        return x[: d - 1].astype(dtype)
