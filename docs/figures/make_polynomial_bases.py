"""The figure and numbers of docs/polynomial_bases.md.

- `polynomial_bases_conditioning.png`, left: the condition number of the d x d Gram
  matrix of each basis's polynomials sampled at 2d Chebyshev points of the interval
  [0, 2] (the filter-response conditioning: how well a filter's coefficients are
  determined by its response); right: the condition number of the vectors
  `p_k(L) x0` themselves, for the normalised Laplacian of a random graph (n = 400,
  mean degree 8) and a random x0, with unit columns.
- `polynomial_bases.txt`: the numbers at d = 16, 32, 64.
- `chebyshev_vs_lanczos.png` and `chebyshev_vs_lanczos.txt`: the relative error of
  `funm_action` by `method="chebyshev"` (interval [0, 2]) and by `method="lanczos"`
  at the same number of products with the Laplacian, for `exp(-5 L) b` and for a
  smooth step `1 / (1 + exp(-20 (L - 1))) b`, against `eigh`.

Everything is computed with `krylovjax.krylov` in float64. Run from the repository
root (about a minute):

    python docs/figures/make_polynomial_bases.py
"""

import argparse
import pathlib

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import krylovjax  # noqa: E402

DEPTHS = (2, 4, 8, 16, 24, 32, 48, 64)
BASES = {
    "monomial": None,
    "Chebyshev": krylovjax.Chebyshev(0.0, 2.0),
    "Legendre": krylovjax.Legendre(0.0, 2.0),
    "Jacobi(1/2, 1/2)": krylovjax.Jacobi(0.5, 0.5, 0.0, 2.0),
}


def laplacian(n=400, degree=8, seed=0):
    rng = np.random.default_rng(seed)
    upper = np.triu(rng.random((n, n)) < degree / n, 1)
    adjacency = (upper | upper.T).astype(float)
    deg = np.maximum(adjacency.sum(1), 1)
    return np.eye(n) - adjacency / np.sqrt(deg[:, None] * deg[None, :])


def unit_columns(X):
    return X / np.linalg.norm(X, axis=0)


def conditioning():
    L = jnp.asarray(laplacian())
    x0 = jnp.asarray(np.random.default_rng(1).standard_normal(L.shape[0]))
    gram, vectors = {}, {}
    for name, basis in BASES.items():
        gram[name], vectors[name] = [], []
        for d in DEPTHS:
            points = 1 + np.cos(np.pi * (np.arange(2 * d) + 0.5) / (2 * d))
            V = np.asarray(
                krylovjax.krylov(
                    jnp.diag(jnp.asarray(points)), jnp.ones(2 * d), d, basis=basis
                )
            )
            gram[name].append(np.linalg.cond(V.T @ V))
            X = np.asarray(krylovjax.krylov(L, x0, d, basis=basis))
            vectors[name].append(np.linalg.cond(unit_columns(X)))
    return gram, vectors


FUNCTIONS = {
    "exp(-5 L) b": (lambda x: jnp.exp(-5 * x), lambda w: np.exp(-5 * w)),
    "step 1 / (1 + exp(-20 (L - 1))) b": (
        lambda x: jax.nn.sigmoid(20 * (x - 1)),
        lambda w: 1 / (1 + np.exp(-20 * (w - 1))),
    ),
}
ACTION_DEPTHS = (4, 8, 12, 16, 24, 32, 48, 64)


def accuracy():
    L = laplacian()
    b = np.random.default_rng(2).standard_normal(L.shape[0])
    w, V = np.linalg.eigh(L)
    errors = {}
    for name, (f, f_np) in FUNCTIONS.items():
        want = (V * f_np(w)) @ V.T @ b
        for method in ("chebyshev", "lanczos"):
            options = {"interval": (0.0, 2.0)} if method == "chebyshev" else {}
            run = jax.jit(
                lambda L, b, d, method=method, options=options, f=f: (
                    krylovjax.funm_action(f, L, b, d, method=method, **options)
                ),
                static_argnums=2,
            )
            errors[name, method] = [
                float(np.linalg.norm(run(L, b, d) - want) / np.linalg.norm(want))
                for d in ACTION_DEPTHS
            ]
    return errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent))
    out = pathlib.Path(parser.parse_args().out)
    gram, vectors = conditioning()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for name in BASES:
        axes[0].semilogy(DEPTHS, gram[name], "o-", label=name)
        axes[1].semilogy(DEPTHS, vectors[name], "o-", label=name)
    axes[0].set_title("Gram matrix of the polynomials at 2d Chebyshev points")
    axes[1].set_title("vectors $p_k(L) x_0$, random graph, unit columns")
    for ax in axes:
        ax.set_xlabel("d")
        ax.axhline(1 / np.finfo(np.float64).eps, color="gray", lw=0.8, ls="--")
    axes[0].set_ylabel("condition number")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "polynomial_bases_conditioning.png", dpi=110)
    lines = ["basis | Gram d=16 | d=32 | d=64 | vectors d=16 | d=32 | d=64"]
    for name in BASES:
        cols = [DEPTHS.index(d) for d in (16, 32, 64)]
        g = " | ".join(f"{gram[name][i]:.2g}" for i in cols)
        v = " | ".join(f"{vectors[name][i]:.2g}" for i in cols)
        lines.append(f"{name} | {g} | {v}")
    (out / "polynomial_bases.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    errors = accuracy()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, name in zip(axes, FUNCTIONS, strict=True):
        for method in ("chebyshev", "lanczos"):
            ax.semilogy(ACTION_DEPTHS, errors[name, method], "o-", label=method)
        ax.set_title(name)
        ax.set_xlabel("d (products with L)")
    axes[0].set_ylabel("relative error")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "chebyshev_vs_lanczos.png", dpi=110)
    lines = ["f | method | " + " | ".join(f"d={d}" for d in ACTION_DEPTHS)]
    for (name, method), errs in errors.items():
        lines.append(f"{name} | {method} | " + " | ".join(f"{e:.1e}" for e in errs))
    (out / "chebyshev_vs_lanczos.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
