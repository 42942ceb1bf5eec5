r"""`arnoldi`: an orthonormal Krylov basis and the Hessenberg matrix, with exact,
memory-lean derivatives.

**Forward pass.** With $q_0 = x_0 / \nu$, $\nu = \|x_0\|$, step $k = 0, \dots, d-1$
of one `lax.scan` computes

$$w^{(0)} = A q_k, \quad h^{(1)} = Q_k^H w^{(0)}, \quad
  w^{(1)} = w^{(0)} - Q_k h^{(1)}, \quad h^{(2)} = Q_k^H w^{(1)}, \quad
  w^{(2)} = w^{(1)} - Q_k h^{(2)},$$

(the second pass only with `reorthogonalize=True`), $H_{:k, k} = h^{(1)} + h^{(2)}$,
$\beta_k = H_{k+1, k} = \|w^{(2)}\|$ and $q_{k+1} = w^{(2)} / \beta_k$ (at the last
step the residual $r = w^{(2)}$). $Q_k$ is the preallocated basis buffer, whose
columns beyond $k$ are still zero, so each pass is one matrix-vector product with
the whole buffer and nothing is masked. Breakdown (`_orthogonal.py`): $\beta_k = 0$,
$q_{k+1} = 0$, $r = w^{(2)}$, and the later steps are zero. The norms $\nu$ and
$\beta_k$ are scaled against over- and underflow, and a problem in bfloat16 or
float16 runs in float32 (`_orthogonal.py`).

**Tangents** (`arnoldi_tangent`). Differentiating each line, with $m_k$ the mask
of the first $k+1$ entries,

$$\dot w^{(0)} = A \dot q_k + \dot A q_k, \qquad
  \dot h^{(p)} = m_k \odot (\dot Q^H w^{(p-1)} + Q^H \dot w^{(p-1)}), \qquad
  \dot w^{(p)} = \dot w^{(p-1)} - \dot Q h^{(p)} - Q \dot h^{(p)},$$

$\dot\beta_k = \operatorname{Re}\langle q_{k+1}, \dot w^{(2)}\rangle$ and
$\dot q_{k+1} = (\dot w^{(2)} - q_{k+1} \dot\beta_k) / \beta_k$. Every primal
intermediate is recomputed in batch from the outputs, with no product with $A$:
$W = A Q$ is $Q H + r e_{d-1}^\top$, the relation each step establishes as it
computes (one GEMM with the small $H$), $h^{(1)}$ the upper triangle of $Q^H W$,
$h^{(2)} = H - h^{(1)}$ (upper part), and the rows $w^{(1)} = w^{(0)} - Q h^{(1)}$
one GEMM, $W^{(1)} = W - {H^{(1)}}^\top Q$. $\dot A Q$ is one batched product.

**Adjoint** (`arnoldi_adjoint`, the transpose of the tangent map). With Riesz
gradients $G_Q$, $G_H$, $g_r$, $g_\nu$ of the outputs, a buffer $\Lambda$ of
$d + 1$ rows (the gradients $\lambda_j$ of $\dot q_j$ as they accumulate, and one
free row) starts as $[G_Q; 0]$, and one reverse scan runs $k = d-1, \dots, 0$,
carrying the completed $\lambda_{k+1}$ as a separate vector (it starts as
$\lambda_d = g_r$, the gradient of $\dot r$):

$$g^{(2)} = \begin{cases} \lambda_d = g_r & k = d-1 \\
  \lambda_{k+1} / \beta_k + \big(\operatorname{Re} (G_H)_{k+1,k}
  - \operatorname{Re}\langle q_{k+1}, \lambda_{k+1}\rangle / \beta_k\big)\,
  q_{k+1} & k < d-1 \end{cases}$$

then for each pass $p = 2, 1$ (only $p = 1$ without re-orthogonalisation)

$$a^{(p)} = m_k \odot \big((G_H)_{:,k} - Q^H g^{(p)}\big), \quad
  \Lambda \mathrel{+}= \overline{a^{(p)}}\, {w^{(p-1)}}^\top
  - \overline{h^{(p)}}\, {g^{(p)}}^\top, \quad
  g^{(p-1)} = g^{(p)} + Q a^{(p)},$$

(the rank-one updates of both passes as one fused elementwise pass over the
buffer's rows $0, \dots, k$, in place; their coefficients vanish beyond row
$k$). The multiplier $\mu_k = g^{(0)}$ is the gradient of $\dot w^{(0)}_k =
\dots + \dot A q_k$; it is written into row $k + 1$, whose $\lambda_{k+1}$ no
later (smaller) step needs, and the next carried vector is the completed
$\lambda_k = \Lambda_k + A^H g^{(0)}$, so the buffer ends as $[\cdot, \mu_0,
\dots, \mu_{d-1}]$ and the carry as $\lambda_0$. The scan only writes to
$\Lambda$ and reads it after the writes, so XLA updates it in place (no copy of
the buffer per step). Then (Riesz gradients; JAX's cotangents are their
conjugates)

$$g_{x_0} = \lambda_0 / \nu + (g_\nu - \operatorname{Re}\langle q_0, \lambda_0
  \rangle / \nu)\, q_0, \qquad
  \bar A = \sum_{k=0}^{d-1} \mu_k q_k^H \;\; \text{(one batched product)},$$

the second as `operator.param_vjp` over the stacks $Q$ and $M = [\mu_k]$ (a GEMM
for a dense matrix, a sampled product for BCOO, one VJP for a callable). The
residuals are the outputs and the operator; the temporaries are a few $n \times
d$ arrays ($W$, $\Lambda$, and $W^{(1)}$ with re-orthogonalisation), never one
per step.
"""

from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Inexact, Real

from ._operator import AbstractOperator
from ._orthogonal import (
    AbstractStop,
    Adjoint,
    add_outer,
    adjoint_mv,
    as_dtype,
    check_problem,
    combine,
    conj,
    decompose,
    derivative_rule,
    last_step,
    loop_steps,
    next_adjoint,
    next_tangent,
    next_vector,
    normalize,
    operator_tangent,
    project,
)
from ._typing import OperatorLike, StaticInt


class Arnoldi(eqx.Module):
    r"""The Arnoldi decomposition $A Q = Q H + r e_{d-1}^\top$ of
    [`krylovjax.arnoldi`][].

    **Fields:**

    - `basis`: $Q$, `(n, d)`, orthonormal columns $q_0, \dots, q_{d-1}$ with
        $q_0 = x_0 / \|x_0\|$ (zero columns after a breakdown).
    - `hessenberg`: $H = Q^H A Q$, `(d, d)`, upper Hessenberg; its subdiagonal is
        real and $\ge 0$.
    - `residual`: $r$, `(n,)`, orthogonal to $Q$; $r / \|r\|$ would be $q_d$.
    - `norm`: $\|x_0\|$, a real scalar: $x_0 = \|x_0\| Q e_0$.

    !!! Example

        ```python
        >>> import jax.numpy as jnp
        >>> import krylovjax
        >>> A = jnp.array([[1.0, 2.0], [3.0, 4.0]])
        >>> dec = krylovjax.arnoldi(A, jnp.array([2.0, 0.0]), 2)
        >>> dec.basis
        Array([[1., 0.],
               [0., 1.]], dtype=float32)
        >>> dec.norm
        Array(2., dtype=float32)

        ```
    """

    basis: Inexact[Array, "n d"]
    hessenberg: Inexact[Array, "d d"]
    residual: Inexact[Array, " n"]
    norm: Real[Array, ""]


def arnoldi(
    A: OperatorLike,
    x0: Inexact[Array | np.ndarray, " n"],
    d: StaticInt,
    *,
    reorthogonalize: bool = True,
    adjoint: Adjoint = "custom_jvp",
) -> Arnoldi:
    r"""Arnoldi's method: an orthonormal basis $Q$ of the Krylov space
    $\operatorname{span}\{x_0, A x_0, \dots, A^{d-1} x_0\}$ and $H = Q^H A Q$.

    The decomposition satisfies

    $$A Q = Q H + r e_{d-1}^\top, \qquad Q^H Q = I, \qquad Q^H r = 0,
      \qquad x_0 = \|x_0\|\, Q e_0,$$

    with $H$ upper Hessenberg, so that $f(A) x_0 \approx \|x_0\| Q f(H) e_0$. It is
    one `lax.scan` of $d$ applications of $A$, each followed by classical
    Gram-Schmidt against the whole preallocated basis (one matrix-vector product
    per pass). One derivative rule serves forward mode (`jax.jvp`, `jax.jacfwd`,
    `jax.linearize`) and reverse mode (`jax.grad`, `jax.vjp`): the exact
    derivative of the computed algorithm, whose reverse pass keeps only the
    outputs and runs one reverse scan over one `(n, d)` buffer, with the gradient
    of the operator as one batched product (the maths is in the module docstring
    of `krylovjax/_arnoldi.py`).

    **Arguments:**

    - `A`: the operator, any `n x n` operator [`krylovjax.krylov`][] accepts: a
        square array, a `jax.experimental.sparse.BCOO` matrix, or a linear
        callable (a closure, an `equinox.Module`, a bound method); gradients reach
        every floating-point array it holds. A matrix and `x0` are promoted to
        their common dtype.
    - `x0`: the starting vector, shape `(n,)`, floating point or complex. For a
        batch of starting vectors, `jax.vmap` over `x0` (the reverse pass stays
        the hand-written one, and the gradient of a shared `A` is one product over
        the whole batch).
    - `d`: the number of basis vectors, a static Python int, `1 <= d <= n`.
    - `reorthogonalize`: `True` (default): classical Gram-Schmidt twice (CGS2),
        orthonormal to rounding whatever $A$ is. `False`: one pass (CGS), half the
        orthogonalisation work; orthogonality degrades as the basis converges.
    - `adjoint`: `"custom_jvp"` (default): the rule described above.
        `"autodiff"`: JAX's own rules through the same `lax.scan`, which in
        reverse mode saves the basis buffer at every step ($O(n d^2)$ memory).

    **Returns:**

    An [`krylovjax.Arnoldi`][] with `basis` $Q$ `(n, d)`, `hessenberg` $H$
    `(d, d)`, `residual` $r$ `(n,)` and `norm` $\|x_0\|$ (real).

    **Breakdown.** If $A q_k$ lies in the span of $q_0, \dots, q_k$ (an invariant
    subspace found after $k + 1 < d$ vectors; numerically: what remains after
    the orthogonalisation is at most $100\,\varepsilon \|A q_k\|$), then
    $H_{k+1,k} = 0$ and the later columns of $Q$ and $H$ are zero, so
    $f(H) e_0$ sees only the leading $(k+1) \times (k+1)$ block, which is exact.
    The residual is then the (rounding-sized) remainder of step $k$, so that
    $A Q = Q H + r e_k^\top$. A zero `x0` gives all zeros. Values and
    derivatives stay finite.

    **Range and precision.** Norms are computed scaled, as BLAS `nrm2` computes
    them, so that no square over- or underflows: `A` or `x0` scaled by any factor
    within the dtype's range gives the scaled decomposition, with the same basis
    and derivatives scaled alike. A dtype narrower than float32 (bfloat16,
    float16) is computed in float32, where the breakdown test above is
    meaningful: a matrix is cast to float32, a callable is still called on
    vectors of its own dtype (and its result cast to float32), and every output
    is returned in the dtype of the input. Derivatives pass through the casts,
    and the reverse pass is the rule above, run in float32.

    !!! Example

        ```python
        >>> import jax, jax.numpy as jnp
        >>> import krylovjax
        >>> A = jnp.array([[1.0, 2.0], [3.0, 4.0]])
        >>> x0 = jnp.array([1.0, 0.0])
        >>> dec = jax.jit(lambda A, x: krylovjax.arnoldi(A, x, 2))(A, x0)
        >>> dec.hessenberg
        Array([[1., 2.],
               [3., 4.]], dtype=float32)
        >>> jax.jit(jax.grad(lambda x: krylovjax.arnoldi(A, x, 2).norm))(x0)
        Array([1., 0.], dtype=float32)

        ```
    """
    return _run_arnoldi(A, x0, d, reorthogonalize, adjoint, rounded=True)


def arnoldi_in_working_dtype(
    A: OperatorLike,
    x0: Inexact[Array | np.ndarray, " n"],
    d: StaticInt,
    *,
    reorthogonalize: bool = True,
    adjoint: Adjoint = "custom_jvp",
) -> Arnoldi:
    r"""[`krylovjax.arnoldi`][] with its outputs left in the dtype it computes in
    (`_orthogonal.working_dtype`): float32 for a bfloat16 or float16 problem.

    For the functions built on it: a function of $H$ amplifies the rounding of
    $H$ to the half dtype, which they avoid by rounding only their own result."""
    return _run_arnoldi(A, x0, d, reorthogonalize, adjoint, rounded=False)


def arnoldi_with_stop(
    A: OperatorLike,
    x0: Inexact[Array | np.ndarray, " n"],
    d: StaticInt,
    stop: AbstractStop,
    *,
    reorthogonalize: bool = True,
    adjoint: Adjoint = "custom_jvp",
) -> tuple[Arnoldi, Array]:
    """`arnoldi_in_working_dtype`, ended early by `stop` (see "Stopping early" in
    `_orthogonal.py`): the decomposition, zero after the step that ended it, and
    the test's estimate."""
    return _run_arnoldi(A, x0, d, reorthogonalize, adjoint, rounded=False, stop=stop)


def _run_arnoldi(
    A, x0, d, reorthogonalize, adjoint, *, rounded: bool, stop=None
) -> Any:
    operator, x0, d = check_problem(A, x0, d, reorthogonalize, adjoint, "arnoldi")
    reorth = bool(reorthogonalize)
    rule = arnoldi_forward if adjoint == "autodiff" else arnoldi_custom_jvp
    kinds = ("rows", "small", "vector", "small")
    Q, H, r, nu, *estimate = decompose(
        rule, operator, x0, d, reorth, kinds, rounded=rounded, stop=stop
    )
    dec = Arnoldi(basis=Q.T, hessenberg=H, residual=r, norm=nu)
    return dec if stop is None else (dec, estimate[0])


def arnoldi_forward(
    operator: AbstractOperator,
    x0: Array,
    d: int,
    reorth: bool,
    stop: AbstractStop | None = None,
    *,
    early: bool = False,
) -> tuple[Array, ...]:
    """The basis as rows `(d, n)`, $H$, the residual and $\\|x_0\\|$ (and the stop
    test's estimate, with one), by one scan."""
    nu, q0 = normalize(x0)
    Q = jnp.zeros((d, *x0.shape), x0.dtype).at[0].set(q0)
    hs, betas = jnp.zeros((d, d), x0.dtype), jnp.zeros((d,), nu.dtype)

    def run(k, Q, hs, betas, state):
        h, beta, q, w = _step(operator, reorth, Q, k)
        ends = (beta == 0) | (k == d - 1)
        if stop is not None:
            small = lax.stop_gradient(_hessenberg(hs.at[k].set(h), betas))
            state, stops = stop(state, k, small, beta == 0)
            ends = ends | stops
            beta, q = jnp.where(ends, 0, beta), jnp.where(ends, 0, q)
        return h, beta, q, w, ends, state

    def skip(k, Q, hs, betas, state):
        vector = jnp.zeros_like(x0)
        zero = jnp.zeros((), nu.dtype)
        return jnp.zeros((d,), x0.dtype), zero, vector, vector, jnp.asarray(True), state

    def step(carry, k):
        # As in `lanczos_forward`: a step after the end of the basis is skipped,
        # and the buffer written outside the `cond`.
        Q, hs, betas, r, done, state = carry
        args = (k, Q, hs, betas, state)
        if stop is None or early:
            h, beta, q, w, ends, state = run(*args)
        else:
            h, beta, q, w, ends, state = lax.cond(done, skip, run, *args)
        # The last step has no q_d to write: its new vector is the residual, as is
        # that of the step that ends the basis.
        Q = Q.at[k + 1].set(q, mode="drop")
        r = jnp.where(ends & ~done, w, r)
        hs, betas = hs.at[k].set(h), betas.at[k].set(beta)
        return (Q, hs, betas, r, done | ends, state)

    state = None if stop is None else stop.init(d)
    carry = (Q, hs, betas, jnp.zeros_like(x0), jnp.asarray(False), state)
    early = early and stop is not None
    Q, hs, betas, r, _, state = loop_steps(step, carry, d, early)
    out = (Q, _hessenberg(hs, betas), r, nu)
    return out if stop is None else (*out, stop.estimate(state))


def _step(operator, reorth, Q, k):
    r"""Step `k`: the column $h$ of $H$ above the diagonal below it, $\beta_k$,
    $q_{k+1}$ and $w_k$ (the remainder before its normalisation)."""
    w0 = operator.mv(Q[k])
    h = project(Q, w0)
    w = w0 - combine(Q, h)
    if reorth:
        c = project(Q, w)
        w = w - combine(Q, c)
        h = h + c
    beta, q = next_vector(w, w0)
    return h, beta, q, w


def _hessenberg(hs: Array, betas: Array) -> Array:
    """$H$ from the upper parts of its columns `(d, d)` and the step norms `(d,)`
    (the last is not in $H$)."""
    return hs.T + jnp.diag(as_dtype(betas[:-1], hs), -1)


def _recompute(out, reorth: bool):
    r"""The per-step primal intermediates, in batch: for each Gram-Schmidt pass
    `p`, the pair `(W_p, H_p)` of the vectors $w^{(p-1)}$ (rows `(d, n)`) and the
    coefficients $h^{(p)}$ (columns of a `(d, d)` array), and $\beta$ with a zero
    appended (the new vector of the step that ends the basis is the residual,
    not normalised).

    $W^{(0)} = A Q$ and $W^{(1)} = W^{(0)} - {H^{(1)}}^\top Q$ are one GEMM each,
    so the scans only read rows of them."""
    Q, H, r = out[0], out[1], out[2]
    d = Q.shape[0]
    # A q_k = sum_j H_jk q_j (+ r at the step that ends the basis): the step
    # computed A q_k and split it into exactly these parts, so, rounding aside,
    # this is W = A Q without a product with A.
    betas = _append_zero(jnp.real(jnp.diagonal(H, -1)))
    W = (H.T @ Q).at[last_step(betas)].add(r)
    upper = jnp.triu(jnp.ones((d, d), bool))
    H_upper = jnp.where(upper, H, 0)
    if not reorth:
        return [(W, H_upper)], betas
    H1 = jnp.where(upper, conj(Q) @ W.T, 0)
    return [(W, H1), (W - H1.T @ Q, H_upper - H1)], betas


def _append_zero(x: Array) -> Array:
    return jnp.pad(x, (0, 1))


def _passes(passes, k):
    """`(w^(p-1), h^(p))` of each Gram-Schmidt pass of step `k`."""
    return [(W[k], H[:, k]) for W, H in passes]


def arnoldi_tangent(operator, out, t_operator, t_x0, reorth):
    """The tangents of `arnoldi_forward`'s outputs (see the module docstring)."""
    Q, _, _, nu = out
    d = Q.shape[0]
    passes, betas = _recompute(out, reorth)
    last = last_step(betas)
    U = operator_tangent(operator, t_operator, Q)
    t_nu, t_q0 = next_tangent(Q[0], nu, t_x0)
    t_Q = jnp.zeros_like(Q).at[0].set(t_q0)
    rows = jnp.arange(d)

    def step(carry, k):
        t_Q, t_r = carry
        m = rows <= k
        t_w = operator.mv(t_Q[k])
        if U is not None:
            t_w = t_w + U[k]
        t_h = jnp.zeros(d, Q.dtype)
        for w_prev, h_p in _passes(passes, k):
            t_hp = jnp.where(m, project(t_Q, w_prev) + project(Q, t_w), 0)
            t_w = t_w - combine(t_Q, h_p) - combine(Q, t_hp)
            t_h = t_h + t_hp
        # At the last step beta = 0 (appended): t_q = 0, not written anyway.
        t_beta, t_q = next_tangent(Q[k + 1], betas[k], t_w)
        t_Q = t_Q.at[k + 1].set(t_q, mode="drop")
        return (t_Q, jnp.where(k == last, t_w, t_r)), (t_h, t_beta)

    carry = (t_Q, jnp.zeros_like(t_q0))
    (t_Q, t_r), (t_hs, t_betas) = lax.scan(step, carry, jnp.arange(d))
    return t_Q, _hessenberg(t_hs, t_betas), t_r, t_nu


def arnoldi_adjoint(operator, out, ct, reorth):
    """The transpose of `arnoldi_tangent`: JAX cotangents of $x_0$ and of the stack
    $A Q$ (rows), by one reverse scan (see the module docstring)."""
    Q, _, _, nu = out
    d = Q.shape[0]
    ct_Q, ct_H, ct_r, ct_nu = ct
    G_H = conj(ct_H)
    g_betas = _append_zero(jnp.real(jnp.diagonal(G_H, -1)))
    passes, betas = _recompute(out, reorth)
    last = last_step(betas)
    transpose_mv = operator.transpose().mv
    rows = jnp.arange(d)

    def step(carry, k):
        # lam: the (complete) gradient of q_(k+1); at the step that ends the basis,
        # g is that of r. The buffer Lam is only updated here, never read before
        # the update: so XLA updates it in place rather than copying it.
        Lam, lam = carry
        m = rows <= k
        g = next_adjoint(Q[k + 1], betas[k], lam, g_betas[k])
        g = jnp.where(k == last, conj(ct_r), g)
        g_h = jnp.where(m, G_H[:, k], 0)
        left, right = [], []
        for w_prev, h_p in reversed(_passes(passes, k)):
            a = jnp.where(m, g_h - project(Q, g), 0)
            left += [-h_p, a]
            right += [g, w_prev]
            g = g + combine(Q, a)
        # The rank-one updates of both passes in one pass over rows 0 .. k.
        Lam = add_outer(Lam, left, right, k)
        # mu_k = g: into the row of q_(k+1), which no later step reads.
        Lam = Lam.at[k + 1].set(g)
        return (Lam, Lam[k] + adjoint_mv(transpose_mv, g)), None

    # Rows: the gradients of q_0 .. q_(d-1), and a free row for mu_(d-1).
    Lam = jnp.pad(conj(ct_Q), ((0, 1), (0, 0)))
    carry = (Lam, jnp.zeros_like(ct_r))
    (Lam, lam0), _ = lax.scan(step, carry, jnp.arange(d), reverse=True)
    g_x0 = next_adjoint(Q[0], nu, lam0, ct_nu)
    return conj(g_x0), conj(Lam[1:])


arnoldi_custom_jvp = derivative_rule(
    "arnoldi", arnoldi_forward, arnoldi_tangent, arnoldi_adjoint
)
