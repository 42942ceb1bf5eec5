r"""Measure what the docs page on bases shows: conditioning and accuracy against d.

Writes into `docs/figures/` (or `--out DIR`):

- `bases_conditioning.png`: the 2-norm condition number of the raw Krylov matrix
  $[x_0, A x_0, \dots, A^{d-1} x_0]$ (as built by `krylovjax.krylov`, and with its
  columns scaled to unit length) against that of the orthonormal bases of
  `krylovjax.arnoldi` and `krylovjax.lanczos`, with and without
  re-orthogonalisation, as `d` grows, in float64;
- `bases_accuracy.txt`: a markdown table of the relative error of
  `krylovjax.funm_action` against a dense float64 reference, and of the loss of
  orthogonality $\|Q^* Q - I\|_2$, for several `d`, with and without
  re-orthogonalisation, in float32 and float64.

The basis of `d` vectors is the first `d` columns of the basis of more vectors (each
step depends only on the earlier ones), so each configuration is computed once, at
the largest `d`. Run from the repository root:

    python docs/figures/make_bases.py

It takes a minute or two on two CPU cores.
"""

import argparse
import pathlib

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import jax.scipy.linalg  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
import scipy.linalg  # noqa: E402

import krylovjax  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
N = 400


def symmetric_problem(n: int = N) -> tuple[np.ndarray, np.ndarray]:
    """A symmetric positive definite matrix with eigenvalues spread geometrically
    over [1e-2, 1e1] (condition number 1e3), and a random vector."""
    rng = np.random.default_rng(0)
    Q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    S = (Q * np.geomspace(1e-2, 1e1, n)) @ Q.T
    return (S + S.T) / 2, rng.normal(size=n)


def convection_diffusion(n: int = N, peclet: float = 0.5) -> np.ndarray:
    """The 1-D convection-diffusion operator (central differences, unit grid
    spacing scaled so that the spectrum lies in about [-4, 0]): non-normal."""
    main = -2.0 * np.ones(n)
    upper = (1 - peclet) * np.ones(n - 1)
    lower = (1 + peclet) * np.ones(n - 1)
    return np.diag(main) + np.diag(upper, 1) + np.diag(lower, -1)


def condition(M: np.ndarray) -> float:
    s = np.linalg.svd(M, compute_uv=False)
    return float(s[0] / s[-1]) if s[-1] > 0 else np.inf


def prefix_conditions(M: np.ndarray, depths) -> list[float]:
    return [condition(M[:, :d]) for d in depths]


def orthogonality_loss(Q: np.ndarray) -> float:
    d = Q.shape[1]
    return float(np.linalg.norm(Q.conj().T @ Q - np.eye(d), 2))


def conditioning_figure(path: pathlib.Path) -> None:
    depths = np.arange(2, 81, 2)
    d_max = int(depths[-1])
    S, b = symmetric_problem()
    A = convection_diffusion()
    curves = {}
    for label, M in (("symmetric", S), ("convection-diffusion", A)):
        Mj, bj = jnp.asarray(M), jnp.asarray(b)
        K = np.asarray(krylovjax.krylov(Mj, bj, d_max))
        curves[label] = {
            "raw Krylov matrix": prefix_conditions(K, depths),
            "Krylov, unit columns": prefix_conditions(
                K / np.linalg.norm(K, axis=0), depths
            ),
        }
        for reorth in (True, False):
            suffix = "" if reorth else ", no re-orth."
            Q = krylovjax.arnoldi(Mj, bj, d_max, reorthogonalize=reorth).basis
            curves[label][f"Arnoldi{suffix}"] = prefix_conditions(np.asarray(Q), depths)
            if label == "symmetric":
                Q = krylovjax.lanczos(Mj, bj, d_max, reorthogonalize=reorth).basis
                curves[label][f"Lanczos{suffix}"] = prefix_conditions(
                    np.asarray(Q), depths
                )
    styles = {
        "raw Krylov matrix": ("C3", "-"),
        "Krylov, unit columns": ("C1", "-"),
        "Arnoldi": ("C0", "-"),
        "Arnoldi, no re-orth.": ("C0", "--"),
        "Lanczos": ("C2", "-"),
        "Lanczos, no re-orth.": ("C2", "--"),
    }
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    titles = {
        "symmetric": f"SPD, n = {N}, eigenvalues in [1e-2, 1e1]",
        "convection-diffusion": f"1-D convection-diffusion, n = {N} (non-normal)",
    }
    for ax, (label, series) in zip(axes, curves.items(), strict=True):
        for name, values in series.items():
            color, ls = styles[name]
            clipped = np.minimum(values, 1e18)
            ax.semilogy(depths, clipped, color=color, ls=ls, label=name)
        # 1 / eps: beyond it the matrix is numerically singular; an exactly singular
        # one (infinite condition number) is drawn at 1e18.
        ax.axhline(1 / np.finfo(np.float64).eps, color="grey", lw=0.6, ls=":")
        ax.set(title=titles[label], xlabel="d (number of vectors)")
        ax.legend(fontsize=8, loc="center right")
    axes[0].set_ylabel("condition number (float64)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def accuracy_table() -> str:
    S, b = symmetric_problem()
    A = convection_diffusion()
    problems = [
        (
            "Lanczos, $S^{-1/2} b$, SPD with $\\kappa = 10^3$",
            "lanczos",
            S,
            lambda x: x**-0.5,
            scipy.linalg.fractional_matrix_power(S, -0.5).real @ b,
        ),
        (
            "Arnoldi, $e^{10 A} b$, convection-diffusion",
            "arnoldi",
            A,
            lambda H: jax.scipy.linalg.expm(10 * H),
            scipy.linalg.expm(10 * A) @ b,
        ),
    ]
    depths = (10, 20, 40, 80, 160)
    lines = []
    for title, method, M, f, reference in problems:
        lines += [
            f"**{title}** (n = {N}): relative error of `funm_action` "
            f"(loss of orthogonality $\\|Q^* Q - I\\|_2$ in brackets)",
            "",
            "| d | float64, re-orth. | float64, none | float32, re-orth. "
            "| float32, none |",
            "|---|---|---|---|---|",
        ]
        decompose = krylovjax.lanczos if method == "lanczos" else krylovjax.arnoldi
        cells = {}
        for dtype in (jnp.float64, jnp.float32):
            Mj, bj = jnp.asarray(M, dtype), jnp.asarray(b, dtype)
            for reorth in (True, False):
                run = jax.jit(
                    lambda M, b, d, f=f, method=method, reorth=reorth: (
                        krylovjax.funm_action(
                            f, M, b, d, method=method, reorthogonalize=reorth
                        )
                    ),
                    static_argnums=2,
                )
                Q = np.asarray(
                    decompose(Mj, bj, depths[-1], reorthogonalize=reorth).basis,
                    np.float64,
                )
                for d in depths:
                    y = np.asarray(run(Mj, bj, d), np.float64)
                    err = np.linalg.norm(y - reference) / np.linalg.norm(reference)
                    loss = orthogonality_loss(Q[:, :d])
                    cells[(dtype, reorth, d)] = f"{err:.1e} ({loss:.0e})"
        for d in depths:
            row = [
                cells[(dtype, reorth, d)]
                for dtype in (jnp.float64, jnp.float32)
                for reorth in (True, False)
            ]
            lines.append(f"| {d} | " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def main(out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    figure = out / "bases_conditioning.png"
    conditioning_figure(figure)
    print(f"wrote {figure}")
    table = accuracy_table()
    path = out / "bases_accuracy.txt"
    path.write_text(table)
    print(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", metavar="DIR", default=str(HERE), help="default: docs/figures/"
    )
    main(pathlib.Path(parser.parse_args().out))
