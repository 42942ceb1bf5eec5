r"""Recover the diffusion time of heat spreading on a graph.

Heat placed on a few nodes of a graph spreads by the heat equation
$\dot u = -L u$, with $L = I - D^{-1/2} W D^{-1/2}$ the normalised graph Laplacian,
so after a time $t$ it is $u(t) = e^{-tL} u_0$. We observe $u(t)$ on every node,
with noise, for eight sources, and recover $t$ by minimising the mean squared error
with Adam. Each prediction $e^{-tL} u_0$ is one `krylovjax.funm_action` call:
20 Lanczos steps on the sparse (BCOO) Laplacian and the exponential of the
$20 \times 20$ tridiagonal matrix, differentiated with respect to $t$, which the
scalar function closes over. The data are made by SciPy's
`scipy.sparse.linalg.expm_multiply`, independently of krylovjax.

The graph is a random geometric graph (nodes in the unit square, joined when closer
than a radius), its largest connected component, built by networkx with a fixed
seed; nothing is downloaded.

Run with `python examples/heat_kernel.py [--fast] [--out DIR]`. The figure goes into
`DIR`, or into a new temporary folder if `--out` is not given; the script prints
where it went.
"""

import argparse
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import matplotlib
import networkx as nx
import numpy as np
import optax
import scipy.sparse.linalg
from jax.experimental import sparse

import krylovjax

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TRUE_TIME = 6.0


def load_graph(num_nodes: int) -> tuple[np.ndarray, scipy.sparse.csr_array]:
    """Node positions and the normalised Laplacian of a random geometric graph."""
    radius = 1.8 * np.sqrt(np.log(num_nodes) / (np.pi * num_nodes))
    graph = nx.random_geometric_graph(num_nodes, radius, seed=0)
    graph = graph.subgraph(max(nx.connected_components(graph), key=len)).copy()
    graph = nx.convert_node_labels_to_integers(graph)
    positions = np.array([graph.nodes[i]["pos"] for i in range(len(graph))])
    laplacian = scipy.sparse.csr_array(nx.normalized_laplacian_matrix(graph))
    return positions, laplacian


def main(fast: bool = False, out: str | pathlib.Path | None = None) -> dict:
    start = time.perf_counter()
    num_nodes, steps = (600, 120) if fast else (2000, 200)
    num_sources, depth, noise = 8, 20, 0.02
    positions, laplacian = load_graph(num_nodes)
    n = laplacian.shape[0]
    rng = np.random.default_rng(1)
    sources = np.zeros((num_sources, n), np.float32)
    sources[np.arange(num_sources), rng.choice(n, num_sources, replace=False)] = 1.0

    # Data, by SciPy: the heat after TRUE_TIME, plus noise relative to its scale.
    clean = scipy.sparse.linalg.expm_multiply(-TRUE_TIME * laplacian, sources.T).T
    scale = np.sqrt(np.mean(clean**2))
    observed = clean + noise * scale * rng.normal(size=clean.shape)
    observed = jnp.asarray(observed, jnp.float32)
    L = sparse.BCOO.from_scipy_sparse(laplacian.astype(np.float32))
    u0 = jnp.asarray(sources)
    print(f"graph: {n} nodes, {laplacian.nnz} Laplacian entries; {num_sources} sources")

    @jax.jit
    def predict(log_t: jax.Array) -> jax.Array:
        t = jnp.exp(log_t)

        def heat(u):
            return krylovjax.funm_action(
                lambda x: jnp.exp(-t * x), L, u, depth, method="lanczos"
            )

        return jax.vmap(heat)(u0)

    def loss_fn(log_t: jax.Array) -> jax.Array:
        return jnp.mean((predict(log_t) - observed) ** 2) / scale**2

    optimiser = optax.adam(optax.cosine_decay_schedule(0.1, steps), b1=0.5, b2=0.9)

    @jax.jit
    def step(log_t, opt_state):
        loss, grad = jax.value_and_grad(loss_fn)(log_t)
        updates, opt_state = optimiser.update(grad, opt_state, log_t)
        return optax.apply_updates(log_t, updates), opt_state, loss

    log_t = jnp.asarray(0.0)  # t = 1: the heat has barely spread
    opt_state = optimiser.init(log_t)
    times, losses = [], []
    for i in range(steps):
        log_t, opt_state, loss = step(log_t, opt_state)
        times.append(float(jnp.exp(log_t)))
        losses.append(float(loss))
        if i % 20 == 0 or i == steps - 1:
            print(f"step {i:4d}  loss {losses[-1]:.3e}  t {times[-1]:.4f}")

    fitted = float(jnp.exp(log_t))
    error = abs(fitted - TRUE_TIME) / TRUE_TIME
    # The Krylov approximation itself, at the true time, against SciPy.
    true_log_t = jnp.asarray(np.log(TRUE_TIME), jnp.float32)  # as log_t: no recompile
    krylov_error = float(
        jnp.linalg.norm(predict(true_log_t) - clean) / np.linalg.norm(clean)
    )
    print(f"recovered t = {fitted:.4f}, true t = {TRUE_TIME} (error {error:.2%})")
    print(f"final loss {losses[-1]:.3e} (noise level {noise**2:.1e})")
    print(f"relative error of the {depth}-step Lanczos heat kernel: {krylov_error:.1e}")

    if out is None:
        out = tempfile.mkdtemp(prefix="krylovjax-heat_kernel-")
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    heat_map = np.asarray(observed).sum(axis=0)
    for ax, values, title in (
        (axes[0], heat_map, f"Observed heat, t = {TRUE_TIME} (8 sources, noisy)"),
        (axes[1], np.asarray(predict(log_t)).sum(axis=0), f"Fitted, t = {fitted:.3f}"),
    ):
        image = ax.scatter(*positions.T, c=values, s=6, cmap="inferno")
        ax.scatter(*positions[sources.argmax(axis=1)].T, marker="x", c="C0", s=30)
        ax.set(title=title, xticks=[], yticks=[], aspect="equal")
        fig.colorbar(image, ax=ax, shrink=0.8)
    axes[2].plot(times, color="C0", label="t")
    axes[2].axhline(TRUE_TIME, color="C0", ls=":", lw=1, label="true t")
    axes[2].set(xlabel="Adam step", ylabel="diffusion time t", title="Training")
    twin = axes[2].twinx()
    twin.semilogy(losses, color="C1", label="loss")
    twin.set_ylabel("relative MSE", color="C1")
    axes[2].legend(loc="center right", fontsize=8)
    fig.tight_layout()
    path = out / "heat_kernel.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    elapsed = time.perf_counter() - start
    print(f"figure saved to {path}; {elapsed:.1f} s")

    assert error < 0.05, f"recovered t = {fitted:.4f}, true {TRUE_TIME}"
    assert krylov_error < 1e-4, f"Lanczos heat kernel error {krylov_error:.1e}"
    return {"time": fitted, "error": error, "seconds": elapsed, "figure": str(path)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="a smaller graph")
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="folder for the figure (default: a new temporary folder)",
    )
    args = parser.parse_args()
    main(fast=args.fast, out=args.out)
