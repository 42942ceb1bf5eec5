r"""System identification: recover the dynamics of two coupled damped oscillators.

Two masses on springs, coupled by a third spring and lightly damped, give a linear
system with a four-dimensional state (two positions, two velocities). Sampled every
`dt` seconds it is a discrete-time recurrence $x_{t+1} = K x_t$ with
$K = \exp(A_c\, dt)$. We observe one noisy trajectory and fit
`krylovjax.nn.LinearDynamics` -- a learnable $K$ and $x_0$ -- by minimising the mean
squared error with Adam, starting from $K = I$ and $x_0$ = the first observation.
The trajectory is fitted over a growing horizon (a short prefix first, with a
learning rate that shrinks as the horizon grows), which keeps the far-from-correct
early iterates from being dominated by the exploding or vanishing tail of $K^t x_0$.
The eigenvalues of the recovered $K$ (two damped modes, each a complex-conjugate
pair) are compared with the true ones.

Run with `python examples/fit_linear_dynamics.py [--fast] [--out DIR]`. The figure goes
into `DIR`, or into a new temporary folder if `--out` is not given; the script
prints where it went.
"""

import argparse
import itertools
import pathlib
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg
import matplotlib
import numpy as np
import optax

import krylovjax

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def true_system(dt: float) -> tuple[jax.Array, jax.Array]:
    """Transition matrix and initial state of two coupled damped oscillators."""
    k1, k2, k_c = 1.0, 2.0, 0.5  # spring constants (unit masses)
    c1, c2 = 0.04, 0.08  # damping
    stiffness = jnp.array([[k1 + k_c, -k_c], [-k_c, k2 + k_c]])
    damping = jnp.diag(jnp.array([c1, c2]))
    a_c = jnp.block([[jnp.zeros((2, 2)), jnp.eye(2)], [-stiffness, -damping]])
    K = jax.scipy.linalg.expm(a_c * dt)
    x0 = jnp.array([1.0, -0.5, 0.0, 0.3])
    return K, x0


def match_eigenvalues(true: np.ndarray, found: np.ndarray) -> tuple[np.ndarray, float]:
    """Reorder `found` to the best one-to-one match with `true`; max distance."""
    best, best_err = found, np.inf
    for perm in itertools.permutations(range(len(found))):
        err = np.max(np.abs(true - found[list(perm)]))
        if err < best_err:
            best, best_err = found[list(perm)], err
    return best, float(best_err)


def main(fast: bool = False, out: str | pathlib.Path | None = None) -> dict:
    start = time.perf_counter()
    n, horizon, dt, noise = 4, 200, 0.1, 0.02
    K_true, x0_true = true_system(dt)
    clean = krylovjax.krylov(K_true, x0_true, horizon, layout="rows")
    observed = clean + noise * jax.random.normal(jax.random.key(1), clean.shape)

    model = krylovjax.nn.LinearDynamics(n, horizon, key=jax.random.key(0))
    # A small sampling step means x_(t+1) is close to x_t: start from K = I, and
    # from the first observation as the initial state.
    model = eqx.tree_at(lambda m: m.transition, model, jnp.eye(n))
    model = eqx.tree_at(lambda m: m.x0, model, observed[0])

    def make_step(d, optim):
        @eqx.filter_jit
        def step(model, opt_state):
            def loss_fn(model):
                return jnp.mean((model(horizon=d) - observed[:d]) ** 2)

            loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
            updates, opt_state = optim.update(grads, opt_state, model)
            return eqx.apply_updates(model, updates), opt_state, loss

        return step

    # (horizon, Adam steps, learning rate): the sensitivity of K^t x0 to K grows
    # with t, so the learning rate shrinks as the fitted horizon grows.
    schedule = [
        (20, 300, 1e-2),
        (50, 300, 3e-3),
        (100, 300, 1e-3),
        (horizon, 600, 3e-4),
    ]
    if fast:
        schedule = [
            (20, 150, 1e-2),
            (50, 150, 3e-3),
            (100, 150, 1e-3),
            (horizon, 150, 3e-4),
        ]
    losses = []
    for d, steps, learning_rate in schedule:
        optim = optax.adam(learning_rate)
        opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
        step = make_step(d, optim)
        for i in range(steps):
            model, opt_state, loss = step(model, opt_state)
            losses.append(float(loss))
            if i % 100 == 0 or i == steps - 1:
                print(f"horizon {d:4d}  step {i:4d}  loss {float(loss):.3e}")

    fitted = model()
    final_loss = float(jnp.mean((fitted - observed) ** 2))
    true_eigs = np.asarray(jnp.linalg.eigvals(K_true))
    found_eigs, eig_error = match_eigenvalues(
        true_eigs, np.asarray(jnp.linalg.eigvals(model.transition))
    )
    clean_error = float(jnp.sqrt(jnp.mean((fitted - clean) ** 2)))
    print(f"final loss {final_loss:.3e} (noise variance {noise**2:.1e})")
    print(f"rms distance of the fit to the noise-free trajectory: {clean_error:.3e}")
    for t, f in zip(true_eigs, found_eigs, strict=True):
        print(f"true eigenvalue {t:.4f}   recovered {f:.4f}   |diff| {abs(t - f):.1e}")
    print(f"max eigenvalue error {eig_error:.2e}")
    print(f"recovered x0 {np.asarray(model.x0)}, true x0 {np.asarray(x0_true)}")

    if out is None:
        out = tempfile.mkdtemp(prefix="krylovjax-fit_linear_dynamics-")
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    t = np.arange(horizon) * dt
    for i, label in enumerate(["position 1", "position 2"]):
        axes[0].plot(t, observed[:, i], ".", ms=3, alpha=0.5, color=f"C{i}")
        axes[0].plot(t, fitted[:, i], "-", color=f"C{i}", label=f"{label} (fit)")
    axes[0].set(xlabel="time", ylabel="state", title="Observed (dots) vs fitted")
    axes[0].legend(loc="upper right", fontsize=8)
    axes[1].semilogy(losses)
    for boundary in np.cumsum([s for _, s, _ in schedule])[:-1]:
        axes[1].axvline(boundary, color="grey", lw=0.5, ls="--")
    axes[1].axhline(noise**2, color="k", lw=0.8, ls=":", label="noise variance")
    axes[1].set(xlabel="Adam step", ylabel="MSE", title="Loss (horizon grows at --)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    path = out / "fit_linear_dynamics.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    elapsed = time.perf_counter() - start
    print(f"figure saved to {path}; {elapsed:.1f} s")

    # The fit should reach the noise floor and recover the spectrum.
    eig_tolerance, loss_tolerance = (
        (1e-2, 3 * noise**2) if fast else (1e-3, 1.1 * noise**2)
    )
    assert eig_error < eig_tolerance, f"eigenvalue error {eig_error:.3e}"
    assert final_loss < loss_tolerance, f"final loss {final_loss:.3e}"
    return {
        "final_loss": final_loss,
        "eigenvalue_error": eig_error,
        "seconds": elapsed,
        "figure": str(path),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="fewer steps")
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="folder for the figure (default: a new temporary folder)",
    )
    args = parser.parse_args()
    main(fast=args.fast, out=args.out)
