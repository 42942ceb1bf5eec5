r"""`StateSpaceConv`: a dense linear state-space sequence layer with a Krylov kernel.

A linear state-space model $x_{t+1} = \bar A x_t + \bar B u_t$, $y_t = C x_t + D u_t$
(S4's setting, with a dense rather than structured state matrix) maps an input
sequence to an output sequence by a causal convolution with the kernel
$\bar K_l = C \bar A^l \bar B$. The kernel is the "Krylov function" of S4: it is
$C$ times the block Krylov matrix $[\bar B, \bar A \bar B, \dots, \bar A^{L-1} \bar B]$,
which [`krylovjax.krylov_readout`][] reads off block by block without storing it
(in $O(n c_\text{in} \sqrt L)$ memory under differentiation, where the matrix is
$n c_\text{in} L$ numbers). The convolution itself is done by FFT.

The state matrix is the bilinear (Tustin) discretisation of a dissipative
continuous-time matrix, which keeps $\lVert \bar A \rVert_2 < 1$ for every value of
the parameters, so long kernels never overflow and the kernel is differentiable
everywhere (see [`krylovjax.nn.StateSpaceConv`][]).
"""

import math

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, ArrayLike, DTypeLike, Float, Inexact, PRNGKeyArray, Shaped

from .._checks import as_input, check_dtype, check_size
from .._readout import krylov_readout
from .._sharding import gathered
from .._typing import StaticInt

# The dtypes of `jnp.fft`'s real transforms, which the convolution uses.
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class StateSpaceConv(eqx.Module):
    r"""A dense linear state-space layer applied as a causal convolution.

    **Parameterisation.** With learnable $W, V \in \mathbb{R}^{n \times n}$ and
    step size $\Delta = e^{\delta} > 0$, the continuous-time state matrix is

    $$A_c = (W - W^\top) - (V V^\top + \epsilon I),$$

    a skew-symmetric part (oscillation) minus a positive-definite part (damping,
    at least $\epsilon$ = `min_damping`). Its bilinear discretisation is

    $$\bar A = \left(I - \tfrac{\Delta}{2} A_c\right)^{-1}
      \left(I + \tfrac{\Delta}{2} A_c\right), \qquad
      \bar B = \left(I - \tfrac{\Delta}{2} A_c\right)^{-1} \Delta B.$$

    For $y = \bar A x$ and $u = (I - \tfrac{\Delta}{2} A_c)^{-1} x$ one has
    $\lVert y \rVert^2 - \lVert x \rVert^2 = 2 \Delta\, u^\top A_c u
    \le -2 \Delta \epsilon \lVert u \rVert^2 < 0$, so $\lVert \bar A \rVert_2 < 1$:
    $\bar A^l$ decays for every parameter value, with no norm or eigenvalue to
    differentiate. Small damping and step size give memory over many steps.

    **Output.** For an input $u \in \mathbb{R}^{L \times c_\text{in}}$,

    $$y_t = \sum_{l=0}^{t} \bar K_l\, u_{t-l} + D u_t, \qquad
      \bar K_l = C \bar A^l \bar B \in \mathbb{R}^{c_\text{out} \times c_\text{in}},$$

    where $[\bar K_0, \dots, \bar K_{L-1}] = C\,[\bar B, \bar A \bar B, \dots,
    \bar A^{L-1} \bar B]$ comes from one [`krylovjax.krylov_readout`][] call, and
    the sum is computed by FFT with zero padding to $2L$ (no wrap-around).

    **Memory.** The block Krylov matrix, $n\, c_\text{in} L$ numbers, is never
    formed: the kernel's forward pass keeps one $(n, c_\text{in})$ block and the
    kernel, and its reverse pass, once the $L$ blocks would take more than
    256 MiB, about $3\sqrt L$ blocks (checkpoints every $\lceil\sqrt L\,\rceil$
    steps and one recomputed segment; below that it stores them). At $n = 64$,
    $c_\text{in} = 256$, $L = 16384$ in float32 the kernel's value and gradient
    take 32 MiB of temporaries where the matrix alone is 1 GiB.

    **Dtypes.** The parameters are real, float32 or float64 (the dtypes of
    `jnp.fft`); the contraction argument above needs them real. The input may be
    any array of numbers: it is promoted with the parameter dtype, so integer,
    boolean, float16 and bfloat16 inputs are computed in the layer's dtype, and a
    complex input gives the complex output $y(\operatorname{Re} u) + i\,
    y(\operatorname{Im} u)$ of the same linear map.

    !!! Example

        ```python
        >>> import jax, jax.numpy as jnp
        >>> from krylovjax.nn import StateSpaceConv
        >>> layer = StateSpaceConv(8, 2, 3, 100, key=jax.random.key(0))
        >>> apply = jax.jit(lambda layer, u: layer(u))
        >>> apply(layer, jnp.ones((100, 2))).shape
        (100, 3)
        >>> jax.jit(lambda layer: layer.kernel())(layer).shape
        (100, 3, 2)
        >>> batch = jnp.ones((4, 50, 2))  # a batch of shorter inputs
        >>> jax.jit(jax.vmap(layer))(batch).shape
        (4, 50, 3)
        >>> f32 = StateSpaceConv(8, 2, 3, 100, dtype=jnp.float32, key=jax.random.key(0))
        >>> apply(f32, jnp.ones((100, 2), dtype=jnp.int32)).dtype
        dtype('float32')

        ```
    """

    skew: Float[Array, "n n"]
    damping: Float[Array, "n n"]
    log_step: Float[Array, ""]
    B: Float[Array, "n in"]
    C: Float[Array, "out n"]
    D: Float[Array, "out in"]
    state_size: int = eqx.field(static=True)
    in_channels: int = eqx.field(static=True)
    out_channels: int = eqx.field(static=True)
    length: int = eqx.field(static=True)
    min_damping: float = eqx.field(static=True)

    def __init__(
        self,
        state_size: StaticInt,
        in_channels: StaticInt,
        out_channels: StaticInt,
        length: StaticInt,
        *,
        dt_min: float | int = 1e-3,
        dt_max: float | int = 1e-1,
        min_damping: float | int = 1e-3,
        dtype: DTypeLike | None = None,
        key: PRNGKeyArray,
    ):
        r"""**Arguments:**

        - `state_size`: the state dimension $n$, an `int >= 1`.
        - `in_channels`: the number of input channels $c_\text{in}$.
        - `out_channels`: the number of output channels $c_\text{out}$.
        - `length`: the kernel length $L$, the longest input sequence accepted.
        - `dt_min`, `dt_max`: the initial step size $\Delta$ is drawn log-uniformly
            from `[dt_min, dt_max]` (S4's convention); `0 < dt_min <= dt_max`,
            finite.
        - `min_damping`: a finite $\epsilon > 0$, the least damping rate of $A_c$, which
            keeps $\lVert \bar A \rVert_2 < 1$ strictly.
        - `dtype`: the dtype of the parameters, `jax.numpy.float32` or
            `jax.numpy.float64`. Defaults to either depending on whether JAX is in
            64-bit mode, as in `equinox.nn.Linear`. Complex and half-precision
            dtypes raise a `TypeError` (see **Dtypes** above).
        - `key`: a `jax.random` key for the initialisation (keyword only).

        $W$ is drawn from $\mathcal{N}(0, 1/n)$, $V$ from $\mathcal{N}(0, 10^{-2}/n)$
        (light damping, long memory), and $B$, $C$, $D$ like `equinox.nn.Linear`:
        uniform in $\pm 1/\sqrt{\text{fan-in}}$.
        """
        n = check_size(state_size, "StateSpaceConv(state_size=...)")
        c_in = check_size(in_channels, "StateSpaceConv(in_channels=...)")
        c_out = check_size(out_channels, "StateSpaceConv(out_channels=...)")
        length = check_size(length, "StateSpaceConv(length=...)", what="kernel length")
        if not (0 < dt_min <= dt_max < math.inf):
            msg = (
                "`StateSpaceConv(dt_min=..., dt_max=...)` must satisfy "
                f"0 < dt_min <= dt_max < inf; got dt_min={dt_min!r}, "
                f"dt_max={dt_max!r}."
            )
            raise ValueError(msg)
        if not 0 < min_damping < math.inf:
            msg = (
                "`StateSpaceConv(min_damping=...)` must be finite and > 0; got "
                f"{min_damping!r}."
            )
            raise ValueError(msg)
        arg = "StateSpaceConv(dtype=...)"
        dtype = check_dtype(dtype, arg, allow_complex=False)
        if dtype not in DTYPES:
            msg = (
                f"`{arg}` must be float32 or float64, the dtypes of the FFT that "
                f"applies the kernel; got dtype {dtype}."
            )
            raise TypeError(msg)
        wkey, vkey, dkey, bkey, ckey, skey = jr.split(key, 6)
        self.skew = jr.normal(wkey, (n, n), dtype) / math.sqrt(n)
        self.damping = 0.1 * jr.normal(vkey, (n, n), dtype) / math.sqrt(n)
        self.log_step = jr.uniform(
            dkey, (), dtype, minval=math.log(dt_min), maxval=math.log(dt_max)
        )
        lim_in, lim_n = 1 / math.sqrt(c_in), 1 / math.sqrt(n)
        self.B = jr.uniform(bkey, (n, c_in), dtype, minval=-lim_in, maxval=lim_in)
        self.C = jr.uniform(ckey, (c_out, n), dtype, minval=-lim_n, maxval=lim_n)
        self.D = jr.uniform(skey, (c_out, c_in), dtype, minval=-lim_in, maxval=lim_in)
        self.state_size = n
        self.in_channels = c_in
        self.out_channels = c_out
        self.length = length
        self.min_damping = float(min_damping)

    def discretise(self) -> tuple[Float[Array, "n n"], Float[Array, "n in"]]:
        r"""The discrete-time pair $(\bar A, \bar B)$ (see the class docstring).

        **Returns:**

        `(A_bar, B_bar)` of shapes `(state_size, state_size)` and
        `(state_size, in_channels)`; $\lVert \bar A \rVert_2 < 1$.

        !!! Example

            ```python
            >>> import jax, jax.numpy as jnp
            >>> from krylovjax.nn import StateSpaceConv
            >>> layer = StateSpaceConv(4, 1, 1, 10, key=jax.random.key(0))
            >>> A_bar, B_bar = jax.jit(lambda layer: layer.discretise())(layer)
            >>> bool(jnp.linalg.norm(A_bar, 2) < 1)
            True

            ```
        """
        n = self.state_size
        eye = jnp.eye(n, dtype=self.skew.dtype)
        # The (n, n) parameters are small: on an explicit mesh they are gathered,
        # as W - W^T of a split W would mix two layouts.
        skew, damping = gathered(self.skew), gathered(self.damping)
        a_c = skew - skew.T - damping @ damping.T - self.min_damping * eye
        step = jnp.exp(self.log_step)
        left = eye - 0.5 * step * a_c
        rhs = jnp.concatenate([eye + 0.5 * step * a_c, step * self.B], axis=1)
        solved = jnp.linalg.solve(left, rhs)
        return solved[:, :n], solved[:, n:]

    def kernel(self, length: StaticInt | None = None) -> Float[Array, "L out in"]:
        r"""The convolution kernel $[\bar K_0, \dots, \bar K_{L-1}]$, $\bar K_l = C
        \bar A^l \bar B$.

        **Arguments:**

        - `length`: the number of kernel entries, a static `int`; defaults to the
            layer's `length`.

        **Returns:**

        An array of shape `(length, out_channels, in_channels)`.

        !!! Example

            ```python
            >>> import jax
            >>> from krylovjax.nn import StateSpaceConv
            >>> layer = StateSpaceConv(4, 2, 3, 10, key=jax.random.key(0))
            >>> jax.jit(lambda layer: layer.kernel(6))(layer).shape
            (6, 3, 2)

            ```
        """
        if length is None:
            length = self.length
        length = check_size(length, "StateSpaceConv.kernel(length=...)")
        A_bar, B_bar = self.discretise()
        # (L, out, in): C A_bar^l B_bar read off as the blocks are made.
        return krylov_readout(A_bar, B_bar, length, self.C, layout="rows")

    def __call__(
        self,
        x: Shaped[ArrayLike, "L in"] | list | tuple,
        *,
        key: PRNGKeyArray | None = None,
    ) -> Inexact[Array, "L out"]:
        r"""**Arguments:**

        - `x`: one input sequence of shape `(L, in_channels)`, time first, with
            `L <= length`. An input shorter than the layer's `length` uses the first
            `L` kernel entries (the output is the same as for the input padded with
            zeros at the end, truncated). Batch with `jax.vmap`. Any array of
            numbers, or nested lists: it is promoted with the layer's dtype
            (`jnp.promote_types` by JAX's standard rules, also under strict dtype
            promotion), so an integer or boolean `x` gives the same output as
            `x.astype(dtype)`, and a complex `x` a complex output.
        - `key`: ignored; accepted for compatibility with `equinox.nn`.

        **Returns:**

        The output sequence, shape `(L, out_channels)`, in the layer's dtype
        promoted with that of `x`; $y_t$ depends on $u_0, \dots, u_t$ only
        (causal).
        """
        del key
        x = as_input(x, "StateSpaceConv.__call__(x=...)", self.B.dtype)
        bad_length = x.ndim == 2 and not 1 <= x.shape[0] <= self.length
        if x.ndim != 2 or x.shape[1] != self.in_channels or bad_length:
            msg = (
                f"`StateSpaceConv.__call__(x=...)` must have shape (L, "
                f"{self.in_channels}) with 1 <= L <= length={self.length}, i.e. "
                f"(L, in_channels) for one sequence (use `jax.vmap` for a batch); "
                f"got shape {x.shape}."
            )
            raise ValueError(msg)
        n_time = x.shape[0]
        # The FFT runs along time: on an explicit mesh an input split along time
        # is gathered along it (a split over channels stays).
        x = gathered(x, axis=0)
        kernel = self.kernel(n_time)
        n_fft = 2 * n_time
        if jnp.issubdtype(x.dtype, jnp.complexfloating):
            fft, ifft = jnp.fft.fft, jnp.fft.ifft
        else:
            fft, ifft = jnp.fft.rfft, jnp.fft.irfft
        x_f = fft(x, n=n_fft, axis=0)
        # The kernel is transformed in the layer's dtype, then cast to that of the
        # (promoted) input.
        kernel_f = fft(kernel, n=n_fft, axis=0).astype(x_f.dtype)
        y = ifft(jnp.einsum("foi,fi->fo", kernel_f, x_f), n=n_fft, axis=0)
        return y[:n_time] + x @ self.D.T.astype(x.dtype)
