r"""Fit a Gaussian process's hyperparameters without a Cholesky factorisation.

The negative log marginal likelihood of observations $y$ under a Gaussian process
with kernel matrix $K_\theta = \sigma_f^2 k_\ell(X, X) + \sigma_n^2 I$ (RBF kernel
of lengthscale $\ell$) is

$$\mathcal L(\theta) = \tfrac12\, y^\top K_\theta^{-1} y + \tfrac12 \log\det
K_\theta + \tfrac n2 \log 2\pi,$$

and training a GP means minimising it over $\theta = (\log\ell, \log\sigma_f,
\log\sigma_n)$. A Cholesky factorisation costs $O(n^3)$; this script needs only
products with $K_\theta$, as GPyTorch's stochastic Lanczos does:

- $K_\theta^{-1} y$ by `krylovjax.funm_action(lambda x: 1 / x, K, y, d,
  tol=...)`: Lanczos with its depth chosen by the tolerance;
- $\log\det K_\theta = \operatorname{tr} \log K_\theta$ by
  `krylovjax.trace_funm(jnp.log, K, key, d, estimator="krylov-aware", ...)`
  with one sketch column and one remainder probe, all but the last block
  deflated (the choice docs/bases.md makes for a value and a gradient), a fresh
  key at every step.

`jax.grad` differentiates both through the Lanczos runs, and Adam (optax) follows
the stochastic gradient. The same Adam steps on the exact likelihood (Cholesky)
give the reference: the script checks the estimate and its gradient against it at
the start, and the hyperparameters that both trainings reach.

The data are a draw from the GP itself at known hyperparameters, at points
uniform in the unit square (fixed seeds; nothing is downloaded).

Run with `python examples/gp_marginal_likelihood.py [--fast] [--out DIR]`. The
figure goes into `DIR`, or into a new temporary folder if `--out` is not given;
the script prints where it went.
"""

import argparse
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax

import krylovjax

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

jax.config.update("jax_enable_x64", True)

TRUE = {"lengthscale": 0.2, "signal": 1.0, "noise": 0.1}
NAMES = tuple(TRUE)


def kernel(theta: jax.Array, points: jax.Array) -> jax.Array:
    r"""$K_\theta$ for $\theta = (\log\ell, \log\sigma_f, \log\sigma_n)$."""
    lengthscale, signal, noise = jnp.exp(theta)
    squared = jnp.sum((points[:, None, :] - points[None, :, :]) ** 2, axis=-1)
    K = signal**2 * jnp.exp(-squared / (2 * lengthscale**2))
    return K + noise**2 * jnp.eye(points.shape[0], dtype=K.dtype)


def exact_loss(theta: jax.Array, points: jax.Array, y: jax.Array) -> jax.Array:
    """The negative log marginal likelihood by Cholesky, per data point."""
    L = jnp.linalg.cholesky(kernel(theta, points))
    alpha = jax.scipy.linalg.cho_solve((L, True), y)
    logdet = 2 * jnp.sum(jnp.log(jnp.diagonal(L)))
    n = y.shape[0]
    return (y @ alpha + logdet + n * jnp.log(2 * jnp.pi)) / (2 * n)


def krylov_loss(theta, points, y, key, depth, solve_depth):
    """The same by Lanczos: a solve and a Krylov-aware log-determinant."""
    K = kernel(theta, points)
    alpha = krylovjax.funm_action(
        lambda x: 1 / x, K, y, solve_depth, method="lanczos", tol=1e-8
    )[0]
    logdet = krylovjax.trace_funm(
        jnp.log,
        K,
        key,
        depth,
        num_probes=2,
        estimator="krylov-aware",
        num_sketch=1,
        deflated_blocks=depth - 1,
    )
    n = y.shape[0]
    return (y @ alpha + logdet + n * jnp.log(2 * jnp.pi)) / (2 * n)


def make_data(n: int) -> tuple[jax.Array, jax.Array]:
    """Points uniform in the unit square and a draw of the GP at `TRUE`."""
    rng = np.random.default_rng(0)
    points = rng.uniform(size=(n, 2))
    theta = jnp.log(jnp.asarray([TRUE[k] for k in NAMES]))
    K = np.asarray(kernel(theta, jnp.asarray(points)))
    y = np.linalg.cholesky(K) @ rng.standard_normal(n)
    return jnp.asarray(points), jnp.asarray(y)


def train(loss_fn, theta, steps, keys):
    """Adam on `loss_fn(theta, key)`; the trajectory of theta and the losses."""
    optimiser = optax.adam(optax.cosine_decay_schedule(0.05, steps))

    @jax.jit
    def step(theta, opt_state, key):
        loss, grad = jax.value_and_grad(loss_fn)(theta, key)
        updates, opt_state = optimiser.update(grad, opt_state, theta)
        return optax.apply_updates(theta, updates), opt_state, loss

    opt_state = optimiser.init(theta)
    thetas, losses = [theta], []
    for i in range(steps):
        theta, opt_state, loss = step(theta, opt_state, keys[i])
        thetas.append(theta)
        losses.append(float(loss))
    return np.asarray(jnp.stack(thetas)), np.asarray(losses)


def main(fast: bool = False, out: str | pathlib.Path | None = None) -> dict:
    start = time.perf_counter()
    n, steps = (600, 100) if fast else (2000, 200)
    depth, solve_depth = 100, 200
    points, y = make_data(n)
    print(f"{n} points in the unit square; true hyperparameters {TRUE}")

    def stochastic(theta, key):
        return krylov_loss(theta, points, y, key, depth, solve_depth)

    def exact(theta, key):
        del key
        return exact_loss(theta, points, y)

    keys = jax.random.split(jax.random.key(1), 8)
    estimates = jax.jit(jax.vmap(jax.value_and_grad(stochastic), (None, 0)))
    reference = jax.jit(jax.value_and_grad(exact))

    def compare(theta, when, scale=None):
        """The estimate and its gradient over `keys` against Cholesky's: the
        largest errors relative to the loss and to the gradient's norm (or to
        `scale`), and that norm."""
        values, grads = estimates(theta, keys)
        value, grad = reference(theta, None)
        norm = float(jnp.linalg.norm(grad))
        value_error = float(jnp.max(jnp.abs(values - value)) / jnp.abs(value))
        grad_error = float(jnp.max(jnp.linalg.norm(grads - grad, axis=1)))
        grad_error /= norm if scale is None else scale
        print(
            f"{when}, over {len(keys)} keys: loss {float(value):.5f}, largest "
            f"relative error {value_error:.1e}; gradient "
            f"{np.round(np.asarray(grad), 4)}, largest error {grad_error:.1e} of "
            f"{'its norm' if scale is None else 'the norm at the start'}"
        )
        return value_error, grad_error, norm

    theta0 = jnp.log(jnp.asarray([0.5, 0.5, 0.5]))
    *errors, start_norm = compare(theta0, "at the start")
    step_keys = jax.random.split(jax.random.key(2), steps)
    thetas, losses = train(stochastic, theta0, steps, step_keys)
    exact_thetas, exact_losses = train(exact, theta0, steps, step_keys)
    # Near the optimum the noise is small and more of the spectrum stands above
    # it; the gradient is near zero, so its error is measured against the start's.
    *optimum_errors, _ = compare(
        jnp.asarray(exact_thetas[-1]), "at Cholesky's optimum", start_norm
    )
    found, reference = np.exp(thetas[-1]), np.exp(exact_thetas[-1])
    differences = np.abs(found - reference) / reference
    for name, a, b, c in zip(NAMES, found, reference, differences, strict=True):
        print(
            f"{name:>11}: Lanczos {a:.4f}  Cholesky {b:.4f}  ({c:.1e} apart)"
            f"  true {TRUE[name]}"
        )
    final = float(exact_loss(thetas[-1], points, y))
    optimum = float(exact_loss(exact_thetas[-1], points, y))
    print(f"exact loss at the end: {final:.6f} (Cholesky training: {optimum:.6f})")

    if out is None:
        out = tempfile.mkdtemp(prefix="krylovjax-gp_marginal_likelihood-")
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, name in enumerate(NAMES):
        axes[0].plot(np.exp(thetas[:, i]), color=f"C{i}", label=f"{name}, Lanczos")
        axes[0].plot(
            np.exp(exact_thetas[:, i]), color=f"C{i}", ls=":", label="Cholesky"
        )
    axes[0].set(
        xlabel="Adam step", ylabel="value", yscale="log", title="Hyperparameters"
    )
    axes[0].legend(fontsize=7, ncol=3)
    axes[1].plot(losses, label="Lanczos estimate (fresh key each step)")
    axes[1].plot(exact_losses, ls=":", label="Cholesky")
    axes[1].set(
        xlabel="Adam step",
        ylabel="loss per point",
        title="Negative log marginal likelihood",
    )
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    path = out / "gp_marginal_likelihood.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    elapsed = time.perf_counter() - start
    print(f"figure saved to {path}; {elapsed:.1f} s")

    value_error, grad_error = np.maximum(errors, optimum_errors)
    assert value_error < 1e-3, f"loss estimate {value_error:.1e} from Cholesky's"
    assert grad_error < 0.01, f"gradient estimate {grad_error:.1e} from Cholesky's"
    assert np.all(differences < 1e-3), f"hyperparameters {differences} apart"
    return {
        "found": found.tolist(),
        "reference": reference.tolist(),
        "seconds": elapsed,
        "figure": str(path),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="fewer points and steps")
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="folder for the figure (default: a new temporary folder)",
    )
    args = parser.parse_args()
    main(fast=args.fast, out=args.out)
