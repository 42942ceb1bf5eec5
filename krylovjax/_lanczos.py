r"""`lanczos`: an orthonormal Krylov basis of a symmetric or Hermitian operator and
its tridiagonal matrix, with exact, memory-lean derivatives.

**Forward pass.** With $q_0 = x_0 / \nu$, $\nu = \|x_0\|$, $q_{-1} = 0$ and
$\beta_{-1} = 0$, step $k = 0, \dots, d-1$ of one `lax.scan` computes

$$u = A q_k - \beta_{k-1} q_{k-1}, \quad
  \alpha_k = \operatorname{Re}\langle q_k, u\rangle, \quad
  w^{(1)} = u - \alpha_k q_k, \quad
  c = Q_k^H w^{(1)}, \quad w^{(2)} = w^{(1)} - Q_k c,$$

(the last two only with `reorthogonalize=True`: the three-term recurrence is a
first, local Gram-Schmidt pass, and a classical Gram-Schmidt pass against the whole
preallocated basis buffer is the second; $c$ is rounding-sized and is not kept;
where $\|w^{(2)}\| < \|w^{(1)}\| / \sqrt 2$ a third pass follows, which changes
nothing in exact arithmetic and so nothing below, `_reorthogonalized`),
$\beta_k = \|w^{(2)}\|$ and $q_{k+1} = w^{(2)} / \beta_k$ (at the last step the
residual $r = w^{(2)}$). Breakdown (`_orthogonal.py`): $\beta_k = 0$,
$q_{k+1} = 0$, $r = w^{(2)}$, and the later steps are zero. The norms $\nu$ and
$\beta_k$ are scaled against over- and underflow, and a problem in bfloat16 or
float16 runs in float32 (`_orthogonal.py`).

**Tangents** (`lanczos_tangent`). Differentiating each line,

$$\dot u = A \dot q_k + \dot A q_k - \dot\beta_{k-1} q_{k-1}
  - \beta_{k-1} \dot q_{k-1}, \quad
  \dot\alpha_k = \operatorname{Re}(\langle \dot q_k, u\rangle
  + \langle q_k, \dot u\rangle), \quad
  \dot w^{(1)} = \dot u - \dot\alpha_k q_k - \alpha_k \dot q_k,$$

$$\dot c = m_k \odot (\dot Q^H w^{(1)} + Q^H \dot w^{(1)}), \quad
  \dot w^{(2)} = \dot w^{(1)} - \dot Q c - Q \dot c,$$

then $\dot\beta_k$ and $\dot q_{k+1}$ as for Arnoldi. The primal intermediates are
recomputed in batch from the outputs: without re-orthogonalisation $w^{(1)}_k =
\beta_k q_{k+1}$ (and $r$ at the last step), as the step normalised it, with no
product with $A$; with it, $W^{(1)} = A Q - \beta_{k-1} q_{k-1} - \alpha_k q_k$
row by row (one batched product) and $c$ as the columns of the upper triangle of
$Q^H W^{(1)}$. Then $u = w^{(1)} + \alpha_k q_k$.

**Adjoint** (`lanczos_adjoint`, the transpose of the tangent map). With Riesz
gradients $G_Q$, $g_\alpha$, $g_\beta$, $g_r$, $g_\nu$ of the outputs, the buffer
$\Lambda$ of $d + 1$ rows (the gradients $\lambda_j$ of $\dot q_j$ as they
accumulate, and one free row) starts as $[G_Q; 0]$, and one reverse scan runs
$k = d-1, \dots, 0$ carrying the completed $\lambda_{k+1}$ as a separate vector
($\lambda_d = g_r$, the gradient of $\dot r$) and $\gamma_k$, the gradient of
$\dot\beta_k$ from step $k+1$ ($\gamma_{d-1} = 0$):

$$g = \begin{cases} \lambda_d = g_r & k = d-1 \\
  \lambda_{k+1} / \beta_k + \big((g_\beta)_k + \gamma_k
  - \operatorname{Re}\langle q_{k+1}, \lambda_{k+1}\rangle / \beta_k\big)\,
  q_{k+1} & k < d-1 \end{cases}$$

with re-orthogonalisation, $a = -m_k \odot Q^H g$,
$\Lambda \mathrel{+}= \overline{a}\, {w^{(1)}}^\top - \overline{c}\, g^\top$ (one
fused elementwise pass over the buffer, in place) and $g \mathrel{+}= Q a$;
then, with $\eta = (g_\alpha)_k - \operatorname{Re}\langle q_k, g\rangle$ and
$\mu_k = g + \eta\, q_k$ (the gradient of $\dot u$),

$$\lambda_k \mathrel{+}= A^H \mu_k - \alpha_k g + \eta\, u, \qquad
  \lambda_{k-1} \mathrel{-}= \beta_{k-1} \mu_k, \qquad
  \gamma_{k-1} = -\operatorname{Re}\langle q_{k-1}, \mu_k\rangle,$$

the first into the next carried vector $\lambda_k = \Lambda_k + A^H \mu_k -
\alpha_k g + \eta\, u$, the second into row $k - 1$ of the buffer. $\mu_k$ is
also the gradient of $\dot A q_k$: it is written into row $k + 1$, whose
$\lambda_{k+1}$ no later (smaller) step needs, so the buffer ends as $[\cdot,
\mu_0, \dots, \mu_{d-1}]$ and the carry as $\lambda_0$. The scan only writes to
$\Lambda$ and reads it after the writes, so XLA updates it in place. Then, as for
Arnoldi,

$$g_{x_0} = \lambda_0 / \nu + (g_\nu - \operatorname{Re}\langle q_0, \lambda_0
  \rangle / \nu)\, q_0, \qquad
  \bar A = \sum_{k=0}^{d-1} \mu_k q_k^H \;\; \text{(one batched product)}.$$

Without re-orthogonalisation each reverse step is $O(n)$ work plus one product
with $A^H$, like the forward step. The residuals are the outputs and the
operator; the temporaries are a few $n \times d$ arrays, never one per step.
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
    real_dot,
    second_pass,
)
from ._typing import OperatorLike, StaticInt


class Lanczos(eqx.Module):
    r"""The Lanczos decomposition $A Q = Q T + r e_{d-1}^\top$ of
    [`krylovjax.lanczos`][], with $T$ real, symmetric and tridiagonal.

    **Fields:**

    - `basis`: $Q$, `(n, d)`, orthonormal columns with $q_0 = x_0 / \|x_0\|$ (zero
        columns after a breakdown).
    - `diagonal`: $\alpha$, `(d,)`, real: $T_{kk} = \alpha_k$.
    - `off_diagonal`: $\beta$, `(d - 1,)`, real and $\ge 0$:
        $T_{k+1,k} = T_{k,k+1} = \beta_k$.
    - `residual`: $r$, `(n,)`.
    - `norm`: $\|x_0\|$, a real scalar.

    `matrix()` returns the dense `(d, d)` matrix $T$.

    !!! Example

        ```python
        >>> import jax.numpy as jnp
        >>> import krylovjax
        >>> A = jnp.array([[2.0, 1.0], [1.0, 3.0]])
        >>> dec = krylovjax.lanczos(A, jnp.array([1.0, 0.0]), 2)
        >>> dec.diagonal, dec.off_diagonal
        (Array([2., 3.], dtype=float32), Array([1.], dtype=float32))
        >>> dec.matrix()
        Array([[2., 1.],
               [1., 3.]], dtype=float32)

        ```
    """

    basis: Inexact[Array, "n d"]
    diagonal: Real[Array, " d"]
    off_diagonal: Real[Array, " d-1"]
    residual: Inexact[Array, " n"]
    norm: Real[Array, ""]

    def matrix(self) -> Real[Array, "*batch d d"]:
        """The tridiagonal matrix $T$, `(d, d)` (with any leading batch axes of the
        fields, as after `jax.vmap`)."""
        return jnp.vectorize(_tridiagonal, signature="(d),(e)->(d,d)")(
            self.diagonal, self.off_diagonal
        )


def _tridiagonal(diagonal: Array, off: Array) -> Array:
    return jnp.diag(diagonal) + jnp.diag(off, 1) + jnp.diag(off, -1)


def lanczos(
    A: OperatorLike,
    x0: Inexact[Array | np.ndarray, " n"],
    d: StaticInt,
    *,
    reorthogonalize: bool = True,
    adjoint: Adjoint = "custom_jvp",
) -> Lanczos:
    r"""Lanczos's method for a symmetric (or Hermitian) $A$: an orthonormal basis
    $Q$ of the Krylov space $\operatorname{span}\{x_0, \dots, A^{d-1} x_0\}$ and the
    tridiagonal $T = Q^H A Q$.

    The decomposition satisfies

    $$A Q = Q T + r e_{d-1}^\top, \qquad Q^H Q = I, \qquad x_0 = \|x_0\|\, Q e_0,$$

    with $T$ real symmetric tridiagonal, so that $f(A) x_0 \approx \|x_0\| Q f(T)
    e_0$ and $x_0^H f(A) x_0 \approx \|x_0\|^2 e_0^\top f(T) e_0$ (Lanczos
    quadrature). The eigenvalues of $T$ (Ritz values) approximate those of $A$;
    with $d = n$ and re-orthogonalisation they are those of $A$ to rounding. It is
    one `lax.scan` of $d$ applications of $A$. One derivative rule serves forward
    mode (`jax.jvp`, `jax.jacfwd`, `jax.linearize`) and reverse mode (`jax.grad`,
    `jax.vjp`): the exact derivative of the computed algorithm, whose reverse pass
    keeps only the outputs and runs one reverse scan over one `(n, d)` buffer, with
    the gradient of the operator as one batched product (the maths is in the
    module docstring of `krylovjax/_lanczos.py`).

    **Arguments:**

    - `A`: a symmetric (real) or Hermitian (complex) operator, any kind
        [`krylovjax.krylov`][] accepts: a square array, a
        `jax.experimental.sparse.BCOO` matrix, or a linear callable; gradients
        reach every floating-point array it holds. Symmetry is not checked: for a
        non-symmetric `A` the result is not a decomposition of `A` (use
        [`krylovjax.arnoldi`][]). The derivative is that of the computed
        algorithm with respect to every entry of `A`, symmetric or not.
    - `x0`: the starting vector, shape `(n,)`, floating point or complex. For a
        batch of starting vectors (Hutchinson probes, say), `jax.vmap` over `x0`.
    - `d`: the number of basis vectors, a static Python int, `1 <= d <= n`.
    - `reorthogonalize`: `True` (default): after the three-term recurrence, one
        classical Gram-Schmidt pass against the whole basis (Gram-Schmidt twice,
        counting the recurrence), and a second where the first removed most of
        the vector (near an invariant subspace, where one pass leaves rounding
        along the basis as large as what remains), so $Q$ stays orthonormal to
        rounding and no spurious copies of converged Ritz values appear; each
        step costs two extra products with the basis, four where the second
        pass runs (under `jax.vmap`, at every step). `False`: the plain
        three-term recurrence, $O(n)$ work per step besides $A q_k$;
        orthogonality is lost as Ritz values converge.
    - `adjoint`: `"custom_jvp"` (default): the rule described above.
        `"autodiff"`: JAX's own rules through the same `lax.scan` (with
        re-orthogonalisation, reverse mode saves the basis buffer at every step).

    **Returns:**

    A [`krylovjax.Lanczos`][] with `basis` $Q$ `(n, d)`, `diagonal` $\alpha$
    `(d,)` and `off_diagonal` $\beta$ `(d - 1,)` (both real), `residual` $r$
    `(n,)` and `norm` $\|x_0\|$; `matrix()` gives $T$.

    **Breakdown.** If $A q_k$ lies in the span of $q_0, \dots, q_k$ (an invariant
    subspace after $k + 1 < d$ vectors, such as $x_0$ a combination of $k + 1$
    eigenvectors; numerically: what remains is at most $100\,\varepsilon \|A
    q_k\|$), then $\beta_k = 0$ and the later entries of $Q$, $\alpha$ and $\beta$
    are zero: $T$ is block diagonal and $f(T) e_0$ sees only its exact leading
    block. The residual is then the (rounding-sized) remainder of step $k$, so
    that $A Q = Q T + r e_k^\top$. A zero `x0` gives all zeros. Values and
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
        >>> A = jnp.array([[2.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 4.0]])
        >>> x0 = jnp.array([1.0, 0.0, 0.0])
        >>> lanczos = jax.jit(lambda A, x0: krylovjax.lanczos(A, x0, 3))
        >>> lanczos(A, x0).matrix()
        Array([[2., 1., 0.],
               [1., 3., 1.],
               [0., 1., 4.]], dtype=float32)
        >>> # d = n: trace(T) = trace(A), so its gradient is the identity.
        >>> jax.jit(jax.grad(lambda A: lanczos(A, x0).diagonal.sum()))(A)
        Array([[1., 0., 0.],
               [0., 1., 0.],
               [0., 0., 1.]], dtype=float32)
        >>> # In bfloat16: computed in float32, returned in bfloat16.
        >>> half = lanczos(A.astype(jnp.bfloat16), x0.astype(jnp.bfloat16))
        >>> half.diagonal, half.off_diagonal
        (Array([2, 3, 4], dtype=bfloat16), Array([1, 1], dtype=bfloat16))

        ```
    """
    return _run_lanczos(A, x0, d, reorthogonalize, adjoint, rounded=True)


def lanczos_in_working_dtype(
    A: OperatorLike,
    x0: Inexact[Array | np.ndarray, " n"],
    d: StaticInt,
    *,
    reorthogonalize: bool = True,
    adjoint: Adjoint = "custom_jvp",
) -> Lanczos:
    r"""[`krylovjax.lanczos`][] with its outputs left in the dtype it computes in
    (`_orthogonal.working_dtype`): float32 for a bfloat16 or float16 problem.

    For the functions built on it: a function of $T$ amplifies the rounding of
    $T$ to the half dtype (at eigenvalues near 11, $e^\lambda$ off by 1.5
    bfloat16 epsilons), which they avoid by rounding only their own result."""
    return _run_lanczos(A, x0, d, reorthogonalize, adjoint, rounded=False)


def lanczos_with_stop(
    A: OperatorLike,
    x0: Inexact[Array | np.ndarray, " n"],
    d: StaticInt,
    stop: AbstractStop,
    *,
    reorthogonalize: bool = True,
    adjoint: Adjoint = "custom_jvp",
) -> tuple[Lanczos, Array]:
    """`lanczos_in_working_dtype`, ended early by `stop` (see "Stopping early" in
    `_orthogonal.py`): the decomposition, zero after the step that ended it, and
    the test's estimate."""
    return _run_lanczos(A, x0, d, reorthogonalize, adjoint, rounded=False, stop=stop)


def _run_lanczos(
    A, x0, d, reorthogonalize, adjoint, *, rounded: bool, stop=None
) -> Any:
    operator, x0, d = check_problem(A, x0, d, reorthogonalize, adjoint, "lanczos")
    reorth = bool(reorthogonalize)
    rule = lanczos_forward if adjoint == "autodiff" else lanczos_custom_jvp
    kinds = ("rows", "small", "small", "vector", "small")
    Q, alpha, beta, r, nu, *estimate = decompose(
        rule, operator, x0, d, reorth, kinds, rounded=rounded, stop=stop
    )
    dec = Lanczos(basis=Q.T, diagonal=alpha, off_diagonal=beta, residual=r, norm=nu)
    return dec if stop is None else (dec, estimate[0])


def lanczos_forward(
    operator: AbstractOperator,
    x0: Array,
    d: int,
    reorth: bool,
    stop: AbstractStop | None = None,
    *,
    early: bool = False,
) -> tuple[Array, ...]:
    """The basis as rows `(d, n)`, $\\alpha$, $\\beta$, the residual and
    $\\|x_0\\|$ (and the stop test's estimate, with one), by one scan."""
    nu, q0 = normalize(x0)
    Q = jnp.zeros((d, *x0.shape), x0.dtype).at[0].set(q0)
    real = nu.dtype
    alpha, beta = jnp.zeros((d,), real), jnp.zeros((d,), real)

    def run(k, Q, alpha, beta, state):
        beta_prev = jnp.where(k > 0, beta[jnp.maximum(k - 1, 0)], 0)
        a, b, q, w = _step(operator, reorth, Q, beta_prev, k)
        ends = (b == 0) | (k == d - 1)
        if stop is not None:
            small = lax.stop_gradient((alpha.at[k].set(a), beta[:-1]))
            state, stops = stop(state, k, small, b == 0)
            ends = ends | stops
            b, q = jnp.where(ends, 0, b), jnp.where(ends, 0, q)
        return a, b, q, w, ends, state

    def skip(k, Q, alpha, beta, state):
        zero, vector = jnp.zeros((), real), jnp.zeros_like(x0)
        return zero, zero, vector, vector, jnp.asarray(True), state

    def step(carry, k):
        # The step's work (a product, the Gram-Schmidt passes, the stop test) is
        # skipped once a step has ended the basis; the buffer is written outside
        # the `cond`, which under `vmap` selects between the vectors only.
        Q, alpha, beta, r, done, state = carry
        args = (k, Q, alpha, beta, state)
        if stop is None or early:
            a, b, q, w, ends, state = run(*args)
        else:
            a, b, q, w, ends, state = lax.cond(done, skip, run, *args)
        # The last step has no q_d to write: its new vector is the residual, as is
        # that of the step that ends the basis.
        Q = Q.at[k + 1].set(q, mode="drop")
        r = jnp.where(ends & ~done, w, r)
        alpha, beta = alpha.at[k].set(a), beta.at[k].set(b)
        return (Q, alpha, beta, r, done | ends, state)

    state = None if stop is None else stop.init(d)
    carry = (Q, alpha, beta, jnp.zeros_like(x0), jnp.asarray(False), state)
    early = early and stop is not None
    Q, alpha, beta, r, _, state = loop_steps(step, carry, d, early)
    out = (Q, alpha, beta[:-1], r, nu)
    return out if stop is None else (*out, stop.estimate(state))


def _step(operator, reorth, Q, beta_prev, k):
    r"""Step `k`: $\alpha_k$, $\beta_k$, $q_{k+1}$ and $w_k$ (the remainder before
    its normalisation)."""
    q = Q[k]
    w0 = operator.mv(q)
    u = w0 - as_dtype(beta_prev, q) * Q[jnp.maximum(k - 1, 0)]
    alpha = real_dot(q, u)
    w = u - as_dtype(alpha, q) * q
    if reorth:
        w = _reorthogonalized(Q, w)
    beta, q_next = next_vector(w, w0)
    return alpha, beta, q_next, w


def _reorthogonalized(Q: Array, w: Array) -> Array:
    r"""$w - Q Q^H w$, by one classical Gram-Schmidt pass, and a second where the
    first removed more than $1 - $ `TWICE` of $w$'s norm: its rounding then left
    components along $Q$ of the order of $\varepsilon \|w\|$, large against
    what remains, which one pass more removes (without it, Lanczos in float32
    lost orthogonality completely and overflowed where Ritz values had
    converged into a cluster). In exact arithmetic the second pass changes
    nothing, so the derivative rules, written for that, are unchanged.

    Under `jax.vmap` the runs decide the second pass together
    (`_orthogonal.second_pass`)."""
    out = w - combine(Q, project(Q, w))
    return second_pass(Q, w, out)


def _append_zero(x: Array) -> Array:
    return jnp.pad(x, (0, 1))


def _recompute(operator: AbstractOperator, out, reorth: bool):
    r"""The per-step primal intermediates, in batch: $W^{(1)}$ (rows), $\beta_{k-1}$
    and $\beta_k$ by step (zero where there is none), and the
    re-orthogonalisation coefficients $c$ as columns."""
    Q, alpha, beta, r = out[0], out[1], out[2], out[3]
    d = Q.shape[0]
    beta_prev = jnp.pad(beta, (1, 0))
    betas = _append_zero(beta)
    if not reorth:
        # Without re-orthogonalisation each step normalises w_k itself: w_k =
        # beta_k q_(k+1), and the residual r at the step that ends the basis
        # (`last_step`). No product with A.
        W1 = jnp.concatenate(
            [as_dtype(beta, Q)[:, None] * Q[1:], jnp.zeros_like(r)[None]]
        )
        return W1.at[last_step(betas)].add(r), beta_prev, betas, None
    # With it, w_k = beta_k q_(k+1) + Q c_k, and c is not an output: W^(1) comes
    # from one batched product, and c from it.
    Q_prev = jnp.concatenate([jnp.zeros_like(Q[:1]), Q[:-1]])
    W1 = (
        operator.mm(Q)
        - as_dtype(beta_prev, Q)[:, None] * Q_prev
        - as_dtype(alpha, Q)[:, None] * Q
    )
    C = jnp.where(jnp.triu(jnp.ones((d, d), bool)), conj(Q) @ W1.T, 0)
    return W1, beta_prev, betas, C


def lanczos_tangent(operator, out, t_operator, t_x0, reorth):
    """The tangents of `lanczos_forward`'s outputs (see the module docstring)."""
    Q, alpha, _, _, nu = out
    d = Q.shape[0]
    W1, beta_prev, beta, C = _recompute(operator, out, reorth)
    last = last_step(beta)
    U = operator_tangent(operator, t_operator, Q)
    t_nu, t_q0 = next_tangent(Q[0], nu, t_x0)
    t_Q = jnp.zeros_like(Q).at[0].set(t_q0)
    rows = jnp.arange(d)

    def step(carry, k):
        t_Q, t_beta_prev, t_r = carry
        q, w, a = Q[k], W1[k], as_dtype(alpha[k], Q)
        u = w + a * q
        previous = jnp.maximum(k - 1, 0)
        t_q = t_Q[k]
        t_u = (
            operator.mv(t_q)
            - as_dtype(t_beta_prev, q) * Q[previous]
            - as_dtype(beta_prev[k], q) * t_Q[previous]
        )
        if U is not None:
            t_u = t_u + U[k]
        t_alpha = real_dot(t_q, u) + real_dot(q, t_u)
        t_w = t_u - as_dtype(t_alpha, q) * q - a * t_q
        if C is not None:
            t_c = jnp.where(rows <= k, project(t_Q, w) + project(Q, t_w), 0)
            t_w = t_w - combine(t_Q, C[:, k]) - combine(Q, t_c)
        # At the last step beta = 0 (appended): t_q = 0, not written anyway.
        t_beta, t_q = next_tangent(Q[k + 1], beta[k], t_w)
        t_Q = t_Q.at[k + 1].set(t_q, mode="drop")
        carry = (t_Q, t_beta, jnp.where(k == last, t_w, t_r))
        return carry, (t_alpha, t_beta)

    carry = (t_Q, jnp.zeros((), nu.dtype), jnp.zeros_like(t_q0))
    (t_Q, _, t_r), (t_alpha, t_beta) = lax.scan(step, carry, jnp.arange(d))
    return t_Q, t_alpha, t_beta[:-1], t_r, t_nu


def lanczos_adjoint(operator, out, ct, reorth):
    """The transpose of `lanczos_tangent`: JAX cotangents of $x_0$ and of the stack
    $A Q$ (rows), by one reverse scan (see the module docstring)."""
    Q, alpha, _, _, nu = out
    d = Q.shape[0]
    ct_Q, ct_alpha, ct_beta, ct_r, ct_nu = ct
    ct_beta = _append_zero(ct_beta)
    W1, beta_prev, beta, C = _recompute(operator, out, reorth)
    last = last_step(beta)
    transpose_mv = operator.transpose().mv
    rows = jnp.arange(d)

    def step(carry, k):
        # lam: the (complete) gradient of q_(k+1); gamma that of beta_k through
        # step k + 1. At the step that ends the basis, g is that of r. The buffer
        # Lam is only updated here, never read before the update: so XLA updates
        # it in place.
        Lam, lam, gamma = carry
        g = next_adjoint(Q[k + 1], beta[k], lam, ct_beta[k] + gamma)
        g = jnp.where(k == last, conj(ct_r), g)
        q, w, a = Q[k], W1[k], as_dtype(alpha[k], Q)
        if C is not None:
            coef = jnp.where(rows <= k, -project(Q, g), 0)
            Lam = add_outer(Lam, [-C[:, k], coef], [g, w], k)
            g = g + combine(Q, coef)
        eta = ct_alpha[k] - real_dot(q, g)
        mu = g + as_dtype(eta, q) * q
        u = w + a * q
        previous = jnp.maximum(k - 1, 0)
        lam_k = adjoint_mv(transpose_mv, mu) - a * g + as_dtype(eta, q) * u
        # (At k = 0, beta_prev = 0: nothing is added.)
        Lam = Lam.at[previous].add(-as_dtype(beta_prev[k], q) * mu)
        gamma = jnp.where(k > 0, -real_dot(Q[previous], mu), 0)
        # mu_k: into the row of q_(k+1), which no later step reads.
        Lam = Lam.at[k + 1].set(mu)
        return (Lam, Lam[k] + lam_k, gamma), None

    # Rows: the gradients of q_0 .. q_(d-1), and a free row for mu_(d-1).
    Lam = jnp.pad(conj(ct_Q), ((0, 1), (0, 0)))
    carry = (Lam, jnp.zeros_like(ct_r), jnp.zeros((), nu.dtype))
    (Lam, lam0, _), _ = lax.scan(step, carry, jnp.arange(d), reverse=True)
    g_x0 = next_adjoint(Q[0], nu, lam0, ct_nu)
    return conj(g_x0), conj(Lam[1:])


lanczos_custom_jvp = derivative_rule(
    "lanczos", lanczos_forward, lanczos_tangent, lanczos_adjoint
)
