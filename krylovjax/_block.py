r"""`block_lanczos` and `block_arnoldi`: an orthonormal basis of a block Krylov space
and its block tridiagonal or block Hessenberg matrix, with deflation; and the
block quadrature of matrix functions built on them.

**Forward pass.** For a block $X_0$ of $b$ columns, the first block of the basis
and the triangle $R_0$ with $X_0 = Q_0 R_0$ come from Gram-Schmidt on the columns
of $X_0$ (`_columns`). Step $k = 0, \dots, d-1$ of one `lax.scan` applies $A$ to
the block $Q_k$ (one product with $b$ vectors, `operator.mm` on rows) and
orthogonalises the result $W = A Q_k$:

- Lanczos: $W \mathrel{-}= Q_{k-1} B_{k-1}^H$, $\alpha_k = \operatorname{herm}(Q_k^H
  W)$ (the Hermitian part), $W \mathrel{-}= Q_k \alpha_k$, and with
  `reorthogonalize=True` a classical Gram-Schmidt pass $W \mathrel{-}= Q (Q^H
  W)$ against the whole preallocated basis buffer, and a second where the first
  removed most of a column (`_orthogonal.second_pass`; under `vmap` the blocks
  decide it together); their coefficients are rounding-sized and are not kept
  (with one pass only, float32 lost orthogonality completely near an invariant
  subspace);
- Arnoldi: $C^{(1)} = Q^H W$, $W \mathrel{-}= Q C^{(1)}$, and with
  `reorthogonalize=True` a second pass $C^{(2)}$; the block column $k$ of $H$ above
  its subdiagonal block is $C^{(1)} + C^{(2)}$.

Each is a product of the buffer with the block (BLAS 3). Then the columns of $W$
are made orthonormal one after the other (`_columns`): column $j$ is orthogonalised
against the columns $0, \dots, j-1$ of the new block (twice with
`reorthogonalize=True`) and normalised by `_orthogonal.next_vector`, which applies
the breakdown rule of the single-vector methods column by column: a remainder
whose norm is at most `BREAKDOWN` $\varepsilon$ times the norm of the column
before any orthogonalisation ($\|x_j\|$ for $X_0$, $\|A q_{k,j}\|$ after) is
numerically zero, and the column of $Q_{k+1}$ becomes zero (it is *deflated*). The
coefficients form the upper triangular $B_k$, whose row $j$ is zero for a deflated
column, so that $W = Q_{k+1} B_k$ up to the deflated remainders. A deflated
column of $Q_k$ stays zero through every later step ($A 0 = 0$), so a rank
deficient $X_0$ (a repeated or zero column, columns spanning an invariant
subspace) gives zero columns in $Q$ and zero rows and columns in $T$ or $H$, with
finite values and derivatives (the divisions use the double-`where` trick of
`next_vector`). At the last step the residual block is $W$ before that column
pass: $A Q = Q T + R\, E_{d-1}^\top$ (or $Q H$), to the deflated remainders, each
below its threshold.

**Derivatives.** `adjoint="custom_jvp"` (the default) is a `custom_jvp` rule
on the whole scan (`_lanczos_jvp`, `_arnoldi_jvp`); `adjoint="autodiff"` lets
JAX differentiate the scan itself, which in reverse mode keeps the intermediates
of every step, the basis buffer included: memory growing as $d^2 b\, n$. Both
give the exact derivatives of the computed algorithm, of every order and in
both modes. The rule rests on one fact: step $k$ reads the basis only up to
block $k$, so it gives the same values when run again on the *final* basis with
the later rows masked (`replay=True`: `_project` and `second_pass` take a row
mask). Its tangents come from a second scan that replays each step with JAX's
forward mode, reading the final basis (a constant of that scan) and the step's
product $A Q_k$ from the decomposition's outputs (`_known_product`, which
computes only its tangent), and carrying only the basis's tangents, filled block
by block. Two places would otherwise keep more than a few blocks per step when
reverse mode transposes that scan:

- the new block's own columns: `_columns` orthogonalises column $j$ against the
  columns made before it in the same step, whose tangents the replay cannot
  read from its carry yet. `_columns_known` has its own rule, a loop over the
  columns that carries their tangents and reads the known columns' values;
- the operator's tangent: $\dot A Q_k$ for all blocks is one batched product
  made before the scan (`operator_tangent`), which the scan reads, so that
  reverse mode forms the operator's gradient as one product over all blocks
  (`param_vjp`) instead of adding a full-size gradient at every step.

Each replayed step is recomputed in the reverse pass (`jax.checkpoint`), so that
pass keeps the final basis, the products and the carried tangents: memory
linear in $d$. Measured in `benchmarks/bench_block.py --derivatives`: reverse
mode faster than JAX's rules through the scan and several times leaner; forward
mode slower (the orthogonalisation runs twice).

**Quadrature** (`block_action`, `block_trace_quadrature`). With $C = E_0 R_0$
the first block column of the identity times $R_0$, $f(A) B \approx Q f(T) C$ and
$\operatorname{tr}(Z^H f(A) Z) \approx \operatorname{tr}(C^H f(T) C)$ (block Gauss
quadrature), $f$ applied to the eigenvalues of $T = V \Lambda V^H$
(`jnp.linalg.eigh`). `_funm_columns` computes $f(T) C$ with a hand-written
derivative (Daleckii-Krein): $\mathrm{d} f(T) = V (F \odot V^H \mathrm{d}T\, V)
V^H$ with $F$ the divided differences of `_funm._divided_differences`, finite at
the repeated eigenvalues a deflation leaves (there JAX's rule for `eigh` divides
by zero). Eigenvalues that $C$ does not see (the zero rows and columns of a
deflated column) are moved to the visible one of largest weight, as
`_funm._eigh` does for the single-vector quadrature, so that `f` is finite there
whenever the result is.
"""

import functools
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Inexact

from ._checks import (
    as_array,
    check_choice,
    check_depth,
    check_matrix_shape,
    check_output_size,
    standard_result_type,
)
from ._funm import (
    _MATRIX_FUNCTION_HINT,
    _check_callable,
    _check_output,
    _divided_differences,
    _hidden_point,
    _result_dtype,
    _scalar_function,
    eigh_one_at_a_time,
    function_tangent,
)
from ._operator import AbstractOperator, as_operator
from ._orthogonal import (
    BREAKDOWN,
    _in_dtype,  # pyright: ignore[reportPrivateUsage]
    conj,
    decompose,
    next_vector,
    operator_tangent,
    second_pass,
    working_dtype,
)
from ._rules import tangent_or_none
from ._sharding import check_invariant, gathered
from ._typing import OperatorLike, StaticInt

# The derivative rules the block methods offer, by their `adjoint=` names.
BlockAdjoint = Literal["custom_jvp", "autodiff"]
BLOCK_ADJOINTS: tuple[BlockAdjoint, ...] = ("custom_jvp", "autodiff")


class BlockLanczos(eqx.Module):
    r"""The block Lanczos decomposition $A Q = Q T + R E_{d-1}^\top$ of
    [`krylovjax.block_lanczos`][], with $T$ Hermitian and block tridiagonal.

    **Fields:**

    - `basis`: $Q$, `(n, d b)`, the blocks $Q_0, \dots, Q_{d-1}$ side by side;
        orthonormal columns, zero columns where a column was deflated.
    - `diagonal`: the diagonal blocks $\alpha_k = Q_k^H A Q_k$, `(d, b, b)`,
        Hermitian.
    - `off_diagonal`: the subdiagonal blocks $B_k = Q_{k+1}^H A Q_k$,
        `(d - 1, b, b)`, upper triangular: $T_{k+1,k} = B_k$, $T_{k,k+1} = B_k^H$.
    - `residual`: $R$, `(n, b)`.
    - `factor`: $R_0$, `(b, b)`, upper triangular, with $X_0 = Q_0 R_0$.

    `matrix()` returns the dense `(d b, d b)` matrix $T$.

    !!! Example

        ```python
        >>> import jax, jax.numpy as jnp
        >>> import krylovjax
        >>> A = jnp.diag(jnp.array([1.0, 2.0, 3.0, 4.0]))
        >>> X0 = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
        >>> dec = jax.jit(lambda A: krylovjax.block_lanczos(A, X0, 2))(A)
        >>> dec.basis.shape, dec.factor
        ((4, 4), Array([[1.4142135, 0.       ],
               [0.       , 1.4142135]], dtype=float32))

        ```
    """

    basis: Inexact[Array, "n m"]
    diagonal: Inexact[Array, "d b b"]
    off_diagonal: Inexact[Array, "e b b"]
    residual: Inexact[Array, "n b"]
    factor: Inexact[Array, "b b"]

    def matrix(self) -> Inexact[Array, "*batch m m"]:
        """The block tridiagonal matrix $T$, `(d b, d b)` (with any leading batch
        axes of the fields, as after `jax.vmap`)."""
        return jnp.vectorize(_block_tridiagonal, signature="(d,b,b),(e,b,b)->(m,m)")(
            self.diagonal, self.off_diagonal
        )


class BlockArnoldi(eqx.Module):
    r"""The block Arnoldi decomposition $A Q = Q H + R E_{d-1}^\top$ of
    [`krylovjax.block_arnoldi`][], with $H$ block upper Hessenberg.

    **Fields:**

    - `basis`: $Q$, `(n, d b)`, orthonormal columns, zero columns where a column
        was deflated.
    - `hessenberg`: $H = Q^H A Q$, `(d b, d b)`; its subdiagonal blocks are upper
        triangular, so it has $b$ subdiagonals.
    - `residual`: $R$, `(n, b)`.
    - `factor`: $R_0$, `(b, b)`, upper triangular, with $X_0 = Q_0 R_0$.

    !!! Example

        ```python
        >>> import jax, jax.numpy as jnp
        >>> import krylovjax
        >>> A = jnp.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
        >>> X0 = jnp.array([[1.0], [0.0], [0.0]])
        >>> jax.jit(lambda A: krylovjax.block_arnoldi(A, X0, 3).hessenberg)(A)
        Array([[0., 0., 1.],
               [1., 0., 0.],
               [0., 1., 0.]], dtype=float32)

        ```
    """

    basis: Inexact[Array, "n m"]
    hessenberg: Inexact[Array, "m m"]
    residual: Inexact[Array, "n b"]
    factor: Inexact[Array, "b b"]


def _block_tridiagonal(diagonal: Array, off: Array) -> Array:
    lower = _subdiagonal(off)
    return _on_block_diagonal(diagonal, 0) + lower + conj(lower).T


def block_lanczos(
    A: OperatorLike,
    X0: Inexact[Array | np.ndarray, "n b"],
    d: StaticInt,
    *,
    reorthogonalize: bool = True,
    adjoint: BlockAdjoint = "custom_jvp",
) -> BlockLanczos:
    r"""Block Lanczos for a symmetric (or Hermitian) $A$: an orthonormal basis $Q$
    of the block Krylov space $\operatorname{span}\{X_0, A X_0, \dots, A^{d-1}
    X_0\}$ and the block tridiagonal $T = Q^H A Q$.

    The decomposition satisfies

    $$A Q = Q T + R\, E_{d-1}^\top, \qquad Q^H Q = I, \qquad X_0 = Q_0 R_0,$$

    ($E_{d-1}$ the last block column of the identity) with $T$ Hermitian, block
    tridiagonal with $b \times b$ blocks, so that $f(A) X_0 \approx Q f(T) E_0 R_0$
    and $\operatorname{tr}(X_0^H f(A) X_0) \approx \operatorname{tr}(R_0^H E_0^\top
    f(T) E_0 R_0)$ (block Gauss quadrature). It is one `lax.scan` of $d$ products
    of $A$ with a block of $b$ vectors. Columns of each new block are
    orthonormalised one by one with the breakdown rule of [`krylovjax.lanczos`][]
    (deflation, below); the maths is in the module docstring of
    `krylovjax/_block.py`.

    **Arguments:**

    - `A`: a symmetric (real) or Hermitian (complex) operator, any kind
        [`krylovjax.lanczos`][] accepts (a square array, a
        `jax.experimental.sparse.BCOO` matrix, or a linear callable of one
        vector). Symmetry is not checked.
    - `X0`: the starting block, shape `(n, b)`, floating point or complex.
    - `d`: the number of blocks, a static Python int, `1 <= d` and `d b <= n`.
    - `reorthogonalize`: `True` (default): Gram-Schmidt twice, against the
        whole basis (two extra block passes) and within each block, so $Q$ stays
        orthonormal to rounding. `False`: the block three-term recurrence and one
        pass within each block.
    - `adjoint`: the derivative rule; both give exact derivatives of every order
        in forward and reverse mode. `"custom_jvp"` (default): each step is
        replayed on the final basis with its tangents, so reverse mode keeps
        $O(d b n)$ numbers (memory linear in `d`) and forms the operator's
        gradient as one product; forward mode runs the orthogonalisation twice.
        `"autodiff"`: JAX differentiates the `lax.scan`, and reverse mode keeps
        the basis buffer at every step ($O(d^2 b n)$).

    **Returns:**

    A [`krylovjax.BlockLanczos`][] with `basis` $Q$ `(n, d b)`, `diagonal`
    `(d, b, b)`, `off_diagonal` `(d - 1, b, b)`, `residual` $R$ `(n, b)` and
    `factor` $R_0$ `(b, b)`; `matrix()` gives $T$.

    **Deflation.** A column whose remainder after the orthogonalisation is at
    most $100\,\varepsilon$ times its norm before it is zero in $Q$ and in its
    row of $B_k$ (or of $R_0$), and stays zero in every later block: a repeated
    or zero column of `X0`, or columns that span an invariant subspace, give zero
    columns in `basis` and zero rows and columns in $T$. Values and derivatives
    stay finite. With $d b = n$, no deflation and re-orthogonalisation, the
    eigenvalues of $T$ are those of $A$ to rounding.

    !!! Example

        ```python
        >>> import jax, jax.numpy as jnp
        >>> import krylovjax
        >>> A = jnp.diag(jnp.array([1.0, 2.0, 3.0, 4.0]))
        >>> X0 = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
        >>> @jax.jit
        ... def eigenvalues(A):
        ...     return jnp.linalg.eigvalsh(krylovjax.block_lanczos(A, X0, 2).matrix())
        >>> jnp.round(eigenvalues(A), 4)
        Array([1., 2., 3., 4.], dtype=float32)
        >>> # d b = n: trace(T) = trace(A), so its gradient is the identity.
        >>> def trace(A):
        ...     return jnp.trace(krylovjax.block_lanczos(A, X0, 2).matrix())
        >>> jnp.round(jax.jit(jax.grad(trace))(A), 4) + 0.0
        Array([[1., 0., 0., 0.],
               [0., 1., 0., 0.],
               [0., 0., 1., 0.],
               [0., 0., 0., 1.]], dtype=float32)

        ```
    """
    operator, X0, d = check_block_problem(
        A, X0, d, reorthogonalize, adjoint, "block_lanczos"
    )
    kinds = ("rows", "small", "small", "rows", "small")
    rule = functools.partial(_lanczos_forward, adjoint=adjoint)
    Q, diagonal, off, R, R0 = decompose(
        rule, operator, X0, d, bool(reorthogonalize), kinds
    )
    return BlockLanczos(Q.T, diagonal, off, R.T, R0)


def block_arnoldi(
    A: OperatorLike,
    X0: Inexact[Array | np.ndarray, "n b"],
    d: StaticInt,
    *,
    reorthogonalize: bool = True,
    adjoint: BlockAdjoint = "custom_jvp",
) -> BlockArnoldi:
    r"""Block Arnoldi for any $A$: an orthonormal basis $Q$ of the block Krylov
    space $\operatorname{span}\{X_0, A X_0, \dots, A^{d-1} X_0\}$ and the block
    upper Hessenberg $H = Q^H A Q$.

    The decomposition satisfies

    $$A Q = Q H + R\, E_{d-1}^\top, \qquad Q^H Q = I, \qquad X_0 = Q_0 R_0,$$

    so that $f(A) X_0 \approx Q f(H) E_0 R_0$. It is one `lax.scan` of $d$
    products of $A$ with a block of $b$ vectors, each followed by block
    Gram-Schmidt against the basis and column-by-column Gram-Schmidt within the
    new block, with deflation as in [`krylovjax.block_lanczos`][].

    **Arguments:**

    - `A`: any operator [`krylovjax.arnoldi`][] accepts.
    - `X0`: the starting block, shape `(n, b)`, floating point or complex.
    - `d`: the number of blocks, a static Python int, `1 <= d` and `d b <= n`.
    - `reorthogonalize`: `True` (default): Gram-Schmidt twice (against the basis
        and within each block). `False`: once.
    - `adjoint`: `"custom_jvp"` (default) or `"autodiff"`, as for
        [`krylovjax.block_lanczos`][].

    **Returns:**

    A [`krylovjax.BlockArnoldi`][] with `basis` $Q$ `(n, d b)`, `hessenberg` $H$
    `(d b, d b)`, `residual` $R$ `(n, b)` and `factor` $R_0$ `(b, b)`.

    !!! Example

        ```python
        >>> import jax, jax.numpy as jnp
        >>> import krylovjax
        >>> A = jnp.array([[1.0, 2.0, 0.0], [0.0, 3.0, 1.0], [1.0, 0.0, 2.0]])
        >>> X0 = jnp.eye(3)[:, :1]
        >>> @jax.jit
        ... def similar(A):
        ...     dec = krylovjax.block_arnoldi(A, X0, 3)
        ...     return dec.basis @ dec.hessenberg @ dec.basis.T
        >>> # d b = n: H is similar to A.
        >>> bool(jnp.allclose(similar(A), A, atol=1e-5))
        True

        ```
    """
    operator, X0, d = check_block_problem(
        A, X0, d, reorthogonalize, adjoint, "block_arnoldi"
    )
    kinds = ("rows", "small", "rows", "small")
    rule = functools.partial(_arnoldi_forward, adjoint=adjoint)
    Q, H, R, R0 = decompose(rule, operator, X0, d, bool(reorthogonalize), kinds)
    return BlockArnoldi(Q.T, H, R.T, R0)


def check_block_problem(
    A: Any,
    X0: Any,
    d: Any,
    reorthogonalize: Any,
    adjoint: Any,
    fn_name: str,
    block: str = "X0",
) -> tuple[AbstractOperator, Array, int]:
    """Check the arguments of a block method (whose starting block is called
    `block`); return the operator (in its working dtype), the block in the
    problem's dtype, and `d`."""
    if not isinstance(reorthogonalize, bool | np.bool_):
        msg = (
            f"`{fn_name}(reorthogonalize=...)` must be a bool; got "
            f"{reorthogonalize!r} of type {type(reorthogonalize).__name__}."
        )
        raise TypeError(msg)
    check_choice(adjoint, BLOCK_ADJOINTS, f"{fn_name}(adjoint=...)")
    d = check_depth(d, fn_name)
    X0 = as_array(X0, f"{fn_name}({block}=...)")
    if X0.ndim == 2:
        # Every step mixes the columns: a block split along them is gathered.
        X0 = gathered(X0, 1)
    if X0.ndim != 2:
        msg = f"`{fn_name}({block}=...)` must have shape (n, b); got shape {X0.shape}."
        raise ValueError(msg)
    n, b = X0.shape
    if b == 0 or n == 0:
        msg = (
            f"`{fn_name}({block}=...)` must have at least one row and one column; "
            f"got shape {X0.shape}."
        )
        raise ValueError(msg)
    check_output_size(d * b, [X0[:, 0]], fn_name)
    if d * b > n:
        msg = (
            f"`{fn_name}(d=...)` must satisfy d b <= n = {n} (an orthonormal basis "
            f"of length-{n} vectors has at most {n} of them), with b = {b} the "
            f"columns of `{block}`; got d = {d}."
        )
        raise ValueError(msg)
    # The operator is checked against one column (a callable maps vectors), a
    # matrix's shape against the whole block.
    if hasattr(A, "shape") and not callable(A):
        check_matrix_shape(A.shape, X0, fn_name, block)
    operator, x0 = as_operator(A, X0[:, 0], fn_name, block, column=True)
    check_invariant((operator, X0), f"`{fn_name}`")
    X0 = X0.astype(x0.dtype)
    return _in_dtype(operator, working_dtype(X0.dtype)), X0, d


# ------------------------------------------------------------------ the scans


def _project(Q: Array, W: Array, rows: Array | None = None) -> Array:
    r"""$Q^H W$ for a basis and a block both stored as rows: `(m, b)`; with
    `rows`, a boolean `(m,)` mask, zero outside those rows of `Q`."""
    C = conj(Q) @ W.T
    return C if rows is None else jnp.where(rows[:, None], C, 0)


def _subtract(W: Array, Q: Array, C: Array) -> Array:
    r"""$W - Q C$ in rows: `W - C.T @ Q`."""
    return W - C.T @ Q


def _column(Q: Array, w: Array, scale: Array, j: Array, passes: int):
    """Column `j` of a block, `w`, orthogonalised `passes` times against rows
    `0, ..., j - 1` of `Q` and normalised with the breakdown rule against
    `scale`: the new row and column `j` of $B$."""
    b = Q.shape[0]
    coefficients = jnp.zeros((b,), w.dtype)
    for _ in range(passes):
        c = jnp.where(jnp.arange(b) < j, conj(Q) @ w, 0)
        w = w - c @ Q
        coefficients = coefficients + c
    beta, q = next_vector(w, scale)
    return q, coefficients.at[j].set(beta.astype(w.dtype))


def _columns(W: Array, scale: Array, passes: int) -> tuple[Array, Array]:
    r"""The columns (rows of `W`, `(b, n)`) made orthonormal one by one, each
    against the ones before it `passes` times and then normalised with the
    breakdown rule against `scale` (the rows before any orthogonalisation):
    the new rows $Q$ and the upper triangular $B$ with $W = Q B$ (in columns),
    up to the remainders of deflated columns, whose rows of $Q$ and $B$ are
    zero."""

    def column(carry, j):
        Q, B = carry
        q, c = _column(Q, W[j], scale[j], j, passes)
        return (Q.at[j].set(q), B.at[:, j].set(c)), None

    b = W.shape[0]
    init = (jnp.zeros_like(W), jnp.zeros((b, b), W.dtype))
    (Q, B), _ = lax.scan(column, init, jnp.arange(b))
    return Q, B


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _columns_known(W: Array, scale: Array, done: Array, passes: int):
    """`_columns(W, scale, passes)` when its rows are known already, `done`: the
    replay of `_lanczos_jvp`. Its derivative is that of `_columns` in `W`
    (`done` is a value only)."""
    return _columns(W, scale, passes)


@_columns_known.defjvp
def _columns_known_jvp(passes, primals, tangents):
    r"""Column $j$'s tangent from the tangents of the rows before it, carried,
    and the known rows' values: what the transpose of this loop keeps per
    column is a vector, where JAX's rules through `_columns` keep the rows made
    so far."""
    W, scale, _ = primals
    t_W = tangents[0]
    Q, B = _columns_known(*primals, passes)

    def column(t_Q, j):
        def one(Q, w):
            return _column(Q, w, scale[j], j, passes)

        _, (t_q, t_c) = jax.jvp(one, (Q, W[j]), (t_Q, t_W[j]))
        return t_Q.at[j].set(t_q), t_c

    t_Q, t_B = lax.scan(column, jnp.zeros_like(W), jnp.arange(W.shape[0]))
    return (Q, B), (t_Q, t_B.T)


def _block(Q: Array, k: Array, b: int) -> Array:
    """Block `k` of the basis rows `Q`."""
    return lax.dynamic_slice_in_dim(Q, k * b, b)


@eqx.filter_custom_jvp
def _known_product(operator, Q, U):
    """`operator.mm(Q)` when it is known already, `U` (the replay of
    `_lanczos_jvp`, from the decomposition's own products): only its tangent
    is computed."""
    return U


@_known_product.def_jvp
def _known_product_jvp(primals, tangents):
    operator, Q, U = primals
    t_operator, t_Q, _ = tangents
    t_U = jnp.zeros_like(U) if t_Q is None else operator.mm(t_Q).astype(U.dtype)
    products = operator_tangent(operator, tangent_or_none(t_operator), Q)
    if products is not None:
        t_U = t_U + products.astype(U.dtype)
    return U, t_U


def _product(operator, Q, E, U):
    r"""$A Q$ (`U` when known: the replay's, see `_known_product`), plus `E` (the
    replay's zero whose tangent is $\dot A Q$) when given."""
    U = operator.mm(Q) if U is None else _known_product(operator, Q, U)
    return U if E is None else U + E


def _lanczos_step(operator, Q, k, B_prev, Q_prev, reorth, replay, E=None, U=None):
    r"""Step `k` of block Lanczos on the basis rows `Q` (filled up to block `k`,
    or, with `replay`, the final basis, read up to block `k`): the next block,
    $\alpha_k$, $B_k$, the block $W$ before its column pass and the product
    $A Q_k$. For `E` and `U`, see `_product`."""
    b = B_prev.shape[0]
    passes = 2 if reorth else 1
    Qk = _block(Q, k, b)
    product = _product(operator, Qk, E, U)
    W = _subtract(product, Q_prev, conj(B_prev).T)
    alpha = _project(Qk, W)
    alpha = (alpha + conj(alpha).T) / 2
    W = _subtract(W, Qk, alpha)
    if reorth:
        # And once more where that removed most of a column (near an invariant
        # subspace): one pass then leaves rounding along Q as large as what
        # remains, and in float32 orthogonality was lost completely.
        rows = jnp.arange(Q.shape[0]) < (k + 1) * b if replay else None
        first = _subtract(W, Q, _project(Q, W, rows))
        W = second_pass(Q, W, first, rows)
    if replay:
        Q_next, B = _columns_known(W, product, _block(Q, k + 1, b), passes)
    else:
        Q_next, B = _columns(W, product, passes)
    return Q_next, alpha, B, W, product


def _arnoldi_step(operator, Q, k, b, reorth, replay, E=None, U=None):
    """Step `k` of block Arnoldi (see `_lanczos_step`): the next block, block
    column `k` of $H$ above its subdiagonal block, $B_k$, $W$ and $A Q_k$."""
    d = Q.shape[0] // b - 1
    passes = 2 if reorth else 1
    product = _product(operator, _block(Q, k, b), E, U)
    rows = jnp.arange(Q.shape[0]) < (k + 1) * b if replay else None
    W, column = product, jnp.zeros((Q.shape[0], b), product.dtype)
    for _ in range(passes):
        # Rows (k + 1) b onwards of Q are zero (or masked): `column` is zero there.
        C = _project(Q, W, rows)
        W = _subtract(W, Q, C)
        column = column + C
    if replay:
        Q_next, B = _columns_known(W, product, _block(Q, k + 1, b), passes)
    else:
        Q_next, B = _columns(W, product, passes)
    return Q_next, column[: d * b], B, W, product


def _lanczos_scan(operator, X0, d, reorth):
    """The basis as rows `(d b, n)` (followed by the block the last step made),
    the diagonal and subdiagonal blocks, the residual as rows `(b, n)`, $R_0$
    and the products $A Q_k$, `(d, b, n)`, by one scan."""
    n, b = X0.shape
    passes = 2 if reorth else 1
    X = X0.T
    Q0, R0 = _columns(X, X, passes)
    # One spare block, which the last step writes (its rows are dropped).
    Q = jnp.pad(Q0, ((0, d * b), (0, 0)))

    def step(carry, k):
        Q, B_prev, Q_prev = carry
        Q_next, alpha, B, W, U = _lanczos_step(
            operator, Q, k, B_prev, Q_prev, reorth, replay=False
        )
        Q_k = _block(Q, k, b)
        Q = lax.dynamic_update_slice_in_dim(Q, Q_next, (k + 1) * b, 0)
        return (Q, B, Q_k), (alpha, B, W, U)

    zero = jnp.zeros((b, b), X.dtype)
    carry = (Q, zero, jnp.zeros_like(X))
    (Q, _, _), (alpha, B, W, U) = lax.scan(step, carry, jnp.arange(d))
    return Q, alpha, B, W[-1], R0, U


def _arnoldi_scan(operator, X0, d, reorth):
    """The basis as rows `(d b, n)` (followed by a block of zero rows), the
    block columns of $H$ above the subdiagonal, the subdiagonal blocks, the
    residual as rows `(b, n)`, $R_0$ and the products $A Q_k$, by one scan."""
    n, b = X0.shape
    passes = 2 if reorth else 1
    X = X0.T
    Q0, R0 = _columns(X, X, passes)
    Q = jnp.pad(Q0, ((0, d * b), (0, 0)))

    def step(Q, k):
        Q_next, column, B, W, U = _arnoldi_step(operator, Q, k, b, reorth, replay=False)
        Q = lax.dynamic_update_slice_in_dim(Q, Q_next, (k + 1) * b, 0)
        return Q, (column, B, W, U)

    Q, (columns, B, W, U) = lax.scan(step, Q, jnp.arange(d))
    return Q, columns, B, W[-1], R0, U


def _lanczos_forward(operator, X0, d, reorth, stop=None, *, adjoint):
    """The basis as rows `(d b, n)`, the diagonal and subdiagonal blocks, the
    residual as rows `(b, n)` and $R_0$, differentiated by the `adjoint` rule."""
    del stop
    b = X0.shape[1]
    if adjoint == "custom_jvp":
        out = _lanczos_decomposition(operator, X0, d=d, reorth=reorth)
    else:
        out = _lanczos_scan(operator, X0, d, reorth)
    Q, alpha, B, W, R0, _ = out
    return Q[: d * b], alpha, B[:-1], W, R0


def _arnoldi_forward(operator, X0, d, reorth, stop=None, *, adjoint):
    """The basis as rows `(d b, n)`, $H$, the residual as rows `(b, n)` and $R_0$,
    differentiated by the `adjoint` rule."""
    del stop
    b = X0.shape[1]
    if adjoint == "custom_jvp":
        out = _arnoldi_decomposition(operator, X0, d=d, reorth=reorth)
    else:
        out = _arnoldi_scan(operator, X0, d, reorth)
    Q, columns, B, W, R0, _ = out
    # Block column k of H is columns[k] above the diagonal and B[k] below it.
    H = jnp.transpose(columns, (1, 0, 2)).reshape(d * b, d * b)
    H = H + _subdiagonal(B[:-1])
    return Q[: d * b], H, W, R0


@eqx.filter_custom_jvp
def _lanczos_decomposition(operator, X0, *, d, reorth):
    return _lanczos_scan(operator, X0, d, reorth)


@eqx.filter_custom_jvp
def _arnoldi_decomposition(operator, X0, *, d, reorth):
    return _arnoldi_scan(operator, X0, d, reorth)


def _first_tangents(X0: Array, t_X0: Array | None, Q: Array, reorth: bool):
    """The tangents of the first block and of $R_0$, replayed on the final
    first block."""
    b = X0.shape[1]
    X = X0.T
    t_X = jnp.zeros_like(X) if t_X0 is None else t_X0.T

    def columns(X):
        return _columns_known(X, X, Q[:b], 2 if reorth else 1)

    _, (t_Q0, t_R0) = jax.jvp(columns, (X,), (t_X,))
    return jnp.pad(t_Q0, ((0, Q.shape[0] - b), (0, 0))), t_R0


def _operator_products(operator, t_operator, Q: Array, d: int, b: int) -> Array:
    r"""$\dot A Q_k$ for the blocks $k < d$, `(d, b, n)`, as one batched product
    (zero without `t_operator`): the tangent scan reads them, and reverse mode
    forms the operator's gradient from them as one product over all blocks
    (`param_vjp`) rather than one per step."""
    products = operator_tangent(operator, t_operator, Q[: d * b])
    if products is None:
        return jnp.zeros((d, b, Q.shape[1]), Q.dtype)
    return products.astype(Q.dtype).reshape(d, b, Q.shape[1])


@_lanczos_decomposition.def_jvp
def _lanczos_jvp(primals, tangents, *, d, reorth):
    r"""Forward mode of `_lanczos_scan`: a second scan replays each step on the
    final basis, with its tangents.

    Step $k$ reads the basis only up to block $k$, so it gives the same values
    on the final basis with the later rows masked (`replay=True`). That basis is
    then a constant of the tangent scan, which carries only the basis's
    tangents, filled block by block, and reads $\dot A Q_k$ from one product
    made before it: reverse mode, transposing this scan, keeps a few blocks per
    step, where JAX's rules through the forward scan keep the whole basis at
    every step ($d^2 b n$ numbers) and add up the operator's gradient there."""
    operator, X0 = primals
    t_operator, t_X0 = tangents
    t_operator = tangent_or_none(t_operator)
    out = _lanczos_decomposition(operator, X0, d=d, reorth=reorth)
    Q, _, B, W, _, U = out
    b = X0.shape[1]
    t_Q, t_R0 = _first_tangents(X0, t_X0, Q, reorth)
    B_prev = jnp.concatenate([jnp.zeros_like(B[:1]), B[:-1]])
    products = _operator_products(operator, t_operator, Q, d, b)

    def body(carry, xs):
        t_Q, t_B_prev, _ = carry
        k, B_prev, t_E, U = xs

        # Recomputed in the reverse pass: it then keeps nothing per step but the
        # step's index (about half the memory, at no measured cost in time).
        @jax.checkpoint
        def step(Q, B_prev, E):
            Q_prev = jnp.where(k > 0, _block(Q, jnp.maximum(k - 1, 0), b), 0)
            return _lanczos_step(
                operator, Q, k, B_prev, Q_prev, reorth, replay=True, E=E, U=U
            )

        primals = (Q, B_prev, jnp.zeros_like(t_E))
        t_step = jax.jvp(step, primals, (t_Q, t_B_prev, t_E))[1]
        t_next, t_alpha, t_B, t_W, t_U = t_step
        t_Q = lax.dynamic_update_slice_in_dim(t_Q, t_next, (k + 1) * b, 0)
        return (t_Q, t_B, t_W), (t_alpha, t_B, t_U)

    carry = (t_Q, jnp.zeros_like(B[0]), jnp.zeros_like(W))
    xs = (jnp.arange(d), B_prev, products, U)
    (t_Q, _, t_W), (t_alpha, t_B, t_U) = lax.scan(body, carry, xs)
    return out, (t_Q, t_alpha, t_B, t_W, t_R0, t_U)


@_arnoldi_decomposition.def_jvp
def _arnoldi_jvp(primals, tangents, *, d, reorth):
    """Forward mode of `_arnoldi_scan`, as `_lanczos_jvp`."""
    operator, X0 = primals
    t_operator, t_X0 = tangents
    t_operator = tangent_or_none(t_operator)
    out = _arnoldi_decomposition(operator, X0, d=d, reorth=reorth)
    Q, _, _, W, _, U = out
    b = X0.shape[1]
    t_Q, t_R0 = _first_tangents(X0, t_X0, Q, reorth)
    products = _operator_products(operator, t_operator, Q, d, b)

    def body(carry, xs):
        t_Q, _ = carry
        k, t_E, U = xs

        @jax.checkpoint
        def step(Q, E):
            return _arnoldi_step(operator, Q, k, b, reorth, replay=True, E=E, U=U)

        primals = (Q, jnp.zeros_like(t_E))
        t_next, t_column, t_B, t_W, t_U = jax.jvp(step, primals, (t_Q, t_E))[1]
        t_Q = lax.dynamic_update_slice_in_dim(t_Q, t_next, (k + 1) * b, 0)
        return (t_Q, t_W), (t_column, t_B, t_U)

    carry = (t_Q, jnp.zeros_like(W))
    xs = (jnp.arange(d), products, U)
    (t_Q, t_W), (t_columns, t_B, t_U) = lax.scan(body, carry, xs)
    return out, (t_Q, t_columns, t_B, t_W, t_R0, t_U)


def _subdiagonal(B: Array) -> Array:
    """The `(d b, d b)` matrix with the `(d - 1, b, b)` blocks `B` on its first
    block subdiagonal, zero elsewhere."""
    return _on_block_diagonal(jnp.pad(B, ((0, 1), (0, 0), (0, 0))), 1)


def _on_block_diagonal(blocks: Array, offset: int) -> Array:
    """The `(d b, d b)` matrix with block `k` of the `(d, b, b)` `blocks` in block
    column `k`, `offset` blocks below the diagonal (those that fit), zero elsewhere.
    A `where`, not a scatter into zeros, which has no unambiguous sharding under a
    `vmap` over an axis split over an explicit mesh."""
    d, b, _ = blocks.shape
    rows, columns = np.arange(d)[:, None], np.arange(d)[None, :]
    mask = (rows == columns + offset)[:, None, :, None]
    # Entry [k, i, l, j] is blocks[l, i, j] where k = l + offset.
    out = jnp.where(mask, jnp.moveaxis(blocks, 0, 1)[None], 0)
    # One merge of axes at a time: on an explicit mesh JAX types no other reshape.
    return out.reshape(d * b, d, b).reshape(d * b, d * b)


# -------------------------------------------------------------- the quadrature


def block_action(
    f: Callable[[Array], Array],
    A: OperatorLike,
    B: Inexact[Array | np.ndarray, "n b"],
    d: StaticInt,
    *,
    method: Literal["lanczos", "arnoldi"],
    reorthogonalize: bool = True,
    adjoint: BlockAdjoint = "custom_jvp",
    fn_name: str = "funm_action",
) -> Inexact[Array, "n b"]:
    r"""$f(A)\, B \approx Q f(S) E_0 R_0$ from $d$ blocks of the block Krylov space
    of $A$ and $B$: what [`krylovjax.funm_action`][] computes for a block `b`.

    - `method="lanczos"` ($A$ symmetric or Hermitian): $S = T$ of
        [`krylovjax.block_lanczos`][], `f` a scalar function applied to its
        eigenvalues; a Daleckii-Krein rule differentiates $f(T) E_0 R_0$, finite
        at the repeated eigenvalues a deflation leaves.
    - `method="arnoldi"` (any $A$): $S = H$ of [`krylovjax.block_arnoldi`][], `f`
        a matrix function called on the `(d b, d b)` matrix. The rows and columns
        of deflated columns (zero in $H$, unseen by $E_0 R_0$) get $c$ on the
        diagonal (`_funm._hidden_point`), so that an `f` infinite at 0 (`inv`,
        `log`) stays finite on what the result sees; $f(H) E_0 R_0$ is unchanged.

    Exact (to rounding) for $d b = n$ and for a polynomial $f$ of degree below
    $d$. A zero block gives zeros ($S$ is then replaced by the identity).
    Differentiable in forward and reverse mode, by the decomposition's `adjoint`
    rule.

    !!! Example

        ```python
        >>> import jax, jax.numpy as jnp
        >>> from krylovjax._block import block_action
        >>> A = jnp.diag(jnp.array([1.0, 2.0, 3.0, 4.0]))
        >>> B = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
        >>> @jax.jit
        ... def sqrt_action(A, B):
        ...     return block_action(jnp.sqrt, A, B, 2, method="lanczos")
        >>> jnp.round(sqrt_action(A, B), 4) + 0.0
        Array([[1.    , 0.    ],
               [0.    , 1.4142],
               [1.7321, 0.    ],
               [0.    , 2.    ]], dtype=float32)

        ```
    """
    if method == "lanczos":
        Q, T, C, dtype = _quadrature_setup(
            f, A, B, d, reorthogonalize, adjoint, fn_name, "b"
        )
        fn = _scalar_function(
            f,
            _eigenvalues_like(T),
            f"{fn_name}(f=...)",
            _MATRIX_FUNCTION_HINT,
        )
        Y = _funm_columns(fn, T, C)
    else:
        _check_callable(f, f"{fn_name}(f=...)")
        operator, B, d = check_block_problem(
            A, B, d, reorthogonalize, adjoint, fn_name, "b"
        )
        m = d * B.shape[1]
        work = working_dtype(B.dtype)
        what = f"the ({m}, {m}) matrix H to a ({m}, {m}) array"
        _check_output(
            jax.eval_shape(f, jax.ShapeDtypeStruct((m, m), work)),
            (m, m),
            f"{fn_name}(f=...)",
            what,
        )
        kinds = ("rows", "small", "rows", "small")
        Q_rows, H, _, R0 = decompose(
            functools.partial(_arnoldi_forward, adjoint=adjoint),
            operator,
            B,
            d,
            bool(reorthogonalize),
            kinds,
            rounded=False,
        )
        Q, dtype = Q_rows.T, B.dtype
        C = jnp.pad(R0, ((0, m - R0.shape[0]), (0, 0)))
        Y = f(_seen(f, H, lax.stop_gradient(jnp.any(Q_rows != 0, axis=1)))) @ C
    out = Q.astype(Y.dtype) @ Y if jnp.iscomplexobj(Y) else Q @ Y.astype(Q.dtype)
    return out.astype(_result_dtype(dtype, Y.dtype))


def _seen(f: Callable, H: Array, visible: Array) -> Array:
    r"""$H$ with the rows and columns of deflated columns (`~visible`, zero in
    $H$) given $c$ on the diagonal, `_funm._hidden_point`'s value for the visible
    part; the identity when nothing is visible (a zero block)."""
    block = jnp.where(visible[:, None] & visible[None, :], H, jnp.zeros_like(H))
    c = _hidden_point(f, lax.stop_gradient(block))
    c = jnp.where(jnp.any(visible), c, jnp.ones_like(c))
    return block + jnp.diag(jnp.where(visible, jnp.zeros_like(c), c))


def block_trace_quadrature(
    f: Callable[[Array], Array],
    A: OperatorLike,
    Z: Inexact[Array | np.ndarray, "n b"],
    d: StaticInt,
    *,
    reorthogonalize: bool = True,
    adjoint: BlockAdjoint = "custom_jvp",
) -> Array:
    r"""$\operatorname{tr}(Z^H f(A) Z) \approx \operatorname{tr}(R_0^H E_0^\top f(T)
    E_0 R_0)$, block Gauss quadrature from [`krylovjax.block_lanczos`][] of $A$
    (symmetric or Hermitian) and the probes $Z$; a real scalar for a real $f$.
    With $Z$ of independent Rademacher or Gaussian columns divided by
    $\sqrt{b}$, an estimate of $\operatorname{tr} f(A)$.

    !!! Example

        ```python
        >>> import jax, jax.numpy as jnp
        >>> from krylovjax._block import block_trace_quadrature
        >>> A = jnp.diag(jnp.array([1.0, 2.0, 3.0, 4.0]))
        >>> Z = jnp.eye(4)[:, :2]
        >>> jax.jit(lambda A: block_trace_quadrature(jnp.log, A, Z, 2))(A)
        Array(0.6931472, dtype=float32)

        ```
    """
    _, T, C, dtype = _quadrature_setup(
        f, A, Z, d, reorthogonalize, adjoint, "block_trace_quadrature", "Z"
    )
    fn = _scalar_function(f, _eigenvalues_like(T), "f")
    return _quadrature_value(fn, T, C, dtype)


def block_trace_terms(
    f: Callable[[Array], Array],
    A: OperatorLike,
    Z: Inexact[Array, "k n b"],
    d: int,
    reorthogonalize: bool,
    adjoint: BlockAdjoint,
    fn_name: str,
) -> Array:
    r"""`block_trace_quadrature` of each of the `k` blocks `Z[i]`: the block
    Lanczos runs batched by `jax.vmap`, their small eigenproblems one at a time
    (`lax.map`; jaxlib's batched `eigh` on CPU can deadlock two batches that run
    at once, see `_trace._Runs.quadratures`)."""
    _check_callable(f, f"{fn_name}(f=...)")

    def setup(B):
        _, T, C, _ = _quadrature_setup(
            f, A, B, d, reorthogonalize, adjoint, fn_name, "probes"
        )
        return T, C

    Ts, Cs = jax.vmap(setup)(Z)
    dtype = Z.dtype
    fn = _scalar_function(f, _eigenvalues_like(Ts[0]), f"{fn_name}(f=...)")
    return lax.map(lambda TC: _quadrature_value(fn, TC[0], TC[1], dtype), (Ts, Cs))


def _eigenvalues_like(T: Array) -> Array:
    """Zeros typed like the eigenvalues of the Hermitian `T` (real, and on a mesh
    sharded as `eigh` makes them): the example that `f` is closure-converted on."""
    return jnp.zeros_like(jnp.diagonal(T).real)


def _quadrature_value(fn: Callable, T: Array, C: Array, dtype: Any) -> Array:
    r"""$\operatorname{tr}(C^H f(T) C)$, real for a real `fn`."""
    Y = _funm_columns(fn, T, C)
    out = jnp.sum(conj(C).astype(Y.dtype) * Y)
    if not jnp.iscomplexobj(fn(jnp.diagonal(T).real)):
        # tr(C^H f(T) C) is real for a Hermitian T and a real f.
        out = jnp.real(out)
    if jnp.iscomplexobj(out):
        # A complex f (`log` of an indefinite A) keeps its imaginary part.
        return out.astype(standard_result_type(dtype, out.dtype))
    return out.astype(jnp.finfo(dtype).dtype)


def _quadrature_setup(f, A, B, d, reorthogonalize, adjoint, fn_name, block):
    """The basis, $T$, $E_0 R_0$ (in the working dtype) and the problem's dtype.
    For a zero block, $T$ is the identity instead: its result is multiplied by
    $R_0 = 0$, and `f` may be infinite at 0."""
    _check_callable(f, f"{fn_name}(f=...)")
    operator, B, d = check_block_problem(
        A, B, d, reorthogonalize, adjoint, fn_name, block
    )
    kinds = ("rows", "small", "small", "rows", "small")
    Q, diagonal, off, _, R0 = decompose(
        functools.partial(_lanczos_forward, adjoint=adjoint),
        operator,
        B,
        d,
        bool(reorthogonalize),
        kinds,
        rounded=False,
    )
    T = _block_tridiagonal(diagonal, off)
    T = jnp.where(jnp.any(R0 != 0), T, jnp.eye(T.shape[0], dtype=T.dtype))
    C = jnp.pad(R0, ((0, T.shape[0] - R0.shape[0]), (0, 0)))
    return Q.T, T, C, B.dtype


@eqx.filter_custom_jvp
def _funm_columns(fn: Callable, T: Array, C: Array) -> Array:
    r"""$f(T)\, C$ for a Hermitian $T$, by `eigh`, with what $C$ does not see
    moved (`_eigh_seen`)."""
    lam, V = _eigh_seen(T, C)
    values = fn(lam)
    Vc = V.astype(_common(values, V))
    return Vc @ (values.astype(Vc.dtype)[:, None] * (conj(Vc).T @ C.astype(Vc.dtype)))


def _common(values: Array, V: Array) -> Any:
    return standard_result_type(values.dtype, V.dtype)


def _eigh_seen(T: Array, C: Array) -> tuple[Array, Array]:
    r"""Eigenvalues and eigenvectors of $T$, with the eigenvalues whose
    eigenvectors $C$ does not see ($\|v_i^H C\| \le$ `BREAKDOWN` $\varepsilon
    \|C\|$, as the zero rows and columns of deflated columns: `eigh` mixes the
    eigenvectors of such a repeated eigenvalue to rounding) replaced by the
    visible one of largest weight, as `_funm._eigh` does."""
    lam, V = eigh_one_at_a_time(T)
    # C scaled to a largest entry of 1 first: the sums of squares of a C near the
    # dtype's range (entries below 1e-19 or above 1e19 in float32) under- or
    # overflowed, and every eigenvalue was hidden.
    C = lax.stop_gradient(C)
    top = jnp.max(jnp.abs(C))
    C = C / jnp.where(top > 0, top, jnp.ones_like(top)).astype(C.dtype)
    weights = jnp.sqrt(jnp.sum(jnp.abs(conj(lax.stop_gradient(V)).T @ C) ** 2, axis=1))
    size = jnp.sqrt(jnp.sum(jnp.abs(C) ** 2))
    hidden = weights <= BREAKDOWN * jnp.finfo(lam.dtype).eps * size
    seen = lam[jnp.argmax(weights)]
    return jnp.where(hidden, seen, lam), V


@_funm_columns.def_jvp
def _funm_columns_jvp(primals, tangents):
    fn, T, C = primals
    t_fn, t_T, t_C = tangents
    lam, V = _eigh_seen(T, C)
    values, derivatives = jax.jvp(fn, (lam,), (jnp.ones_like(lam),))
    dtype = _common(values, V)
    Vc, vc = V.astype(dtype), values.astype(dtype)
    G = conj(Vc).T @ C.astype(dtype)
    out = Vc @ (vc[:, None] * G)
    # d(f(T) C) = V (F o (V^H dT V)) V^H C + V diag(df) V^H C + f(T) dC.
    terms = jnp.zeros_like(G)
    if t_T is not None:
        dT = (t_T + conj(t_T).T) / 2
        E = conj(Vc).T @ dT.astype(dtype) @ Vc
        F = _divided_differences(lam, values, derivatives).astype(dtype)
        terms = terms + (F * E) @ G
    if t_C is not None:
        terms = terms + vc[:, None] * (conj(Vc).T @ t_C.astype(dtype))
    dvalues = function_tangent(fn, t_fn, lam)
    if dvalues is not None:
        terms = terms + dvalues.astype(dtype)[:, None] * G
    return out, Vc @ terms
