r"""Semi-supervised node classification on Zachary's karate club.

The club split into two factions, around the instructor ('Mr. Hi') and the
administrator ('Officer'). Given the friendship graph and the faction of only a few
members per side, predict the faction of everyone else.

The model is two `krylovjax.nn.KrylovGraphConv` layers, each a learnable linear map
of the block Krylov features $[H, \hat A H, \dots, \hat A^k H]$ with the normalised
adjacency $\hat A = D^{-1/2}(A + I)D^{-1/2}$ stored as a sparse BCOO matrix. Node
features are one-hot identities (no attributes), so everything the model knows
comes from the graph. It is trained with Adam on the labelled nodes only, and its
accuracy is measured on the unlabelled ones. The graph ships with networkx; nothing
is downloaded.

Run with `python examples/karate_club.py [--fast] [--out DIR]`. The figure goes
into `DIR`, or into a new temporary folder if `--out` is not given; the script
prints where it went.
"""

import argparse
import pathlib
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import matplotlib
import networkx as nx
import numpy as np
import optax
from jax.experimental import sparse

import krylovjax

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CLUBS = ("Mr. Hi", "Officer")


class GraphClassifier(eqx.Module):
    layers: tuple[krylovjax.nn.KrylovGraphConv, ...]

    def __init__(self, num_nodes: int, hidden: int, hops: int, *, key: jax.Array):
        k1, k2 = jr.split(key)
        self.layers = (
            krylovjax.nn.KrylovGraphConv(num_nodes, hidden, hops, key=k1),
            krylovjax.nn.KrylovGraphConv(hidden, len(CLUBS), hops, key=k2),
        )

    def __call__(self, adjacency, features: jax.Array) -> jax.Array:
        hidden = jax.nn.relu(self.layers[0](adjacency, features))
        return self.layers[1](adjacency, hidden)


def load_graph() -> tuple[nx.Graph, sparse.BCOO, np.ndarray]:
    graph = nx.karate_club_graph()
    n = graph.number_of_nodes()
    edges = np.array(graph.edges(), dtype=np.int32)
    # Both directions of every friendship, unweighted.
    indices = np.concatenate([edges, edges[:, ::-1]])
    data = np.ones(len(indices), dtype=np.float32)
    adjacency = sparse.BCOO((jnp.asarray(data), jnp.asarray(indices)), shape=(n, n))
    labels = np.array([CLUBS.index(graph.nodes[i]["club"]) for i in range(n)])
    return graph, adjacency, labels


def main(fast: bool = False, out: str | pathlib.Path | None = None) -> dict:
    start = time.perf_counter()
    graph, adjacency, labels = load_graph()
    n = len(labels)
    a_hat = krylovjax.nn.normalise_adjacency(adjacency)
    features = jnp.eye(n)

    # A few labelled members per faction, drawn at random (fixed seed).
    per_class, steps = 3, (100 if fast else 300)
    rng = np.random.default_rng(0)
    train = np.concatenate(
        [
            rng.choice(np.flatnonzero(labels == c), per_class, replace=False)
            for c in (0, 1)
        ]
    )
    test = np.setdiff1d(np.arange(n), train)
    print(f"labelled nodes: {sorted(train.tolist())}; {len(test)} nodes to predict")

    model = GraphClassifier(n, hidden=16, hops=3, key=jr.key(0))
    optim = optax.adamw(1e-2, weight_decay=5e-3)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    y = jnp.asarray(labels)

    def loss_fn(model):
        logits = model(a_hat, features)[train]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y[train]).mean()

    @eqx.filter_jit
    def step(model, opt_state):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = optim.update(
            grads, opt_state, eqx.filter(model, eqx.is_inexact_array)
        )
        return eqx.apply_updates(model, updates), opt_state, loss

    @eqx.filter_jit
    def accuracy(model):
        predicted = jnp.argmax(model(a_hat, features), axis=-1)
        return jnp.mean(predicted[test] == y[test]), predicted

    initial_acc, _ = accuracy(model)
    print(f"before training: accuracy on unlabelled nodes {float(initial_acc):.3f}")
    losses = []
    for i in range(steps):
        model, opt_state, loss = step(model, opt_state)
        losses.append(float(loss))
        if i % 50 == 0 or i == steps - 1:
            acc, _ = accuracy(model)
            print(f"step {i:4d}  train loss {float(loss):.4f}  test accuracy {acc:.3f}")
    acc, predicted = accuracy(model)
    acc, predicted = float(acc), np.asarray(predicted)
    wrong = [int(i) for i in test if predicted[i] != labels[i]]
    print(f"final accuracy on the {len(test)} unlabelled nodes: {acc:.4f}")
    print(f"misclassified nodes: {wrong}")

    if out is None:
        out = tempfile.mkdtemp(prefix="krylovjax-karate_club-")
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 5.5))
    pos = nx.spring_layout(graph, seed=3)
    colours = np.array(["C0", "C1"])[predicted]
    nx.draw_networkx_edges(graph, pos, ax=ax, alpha=0.3)
    is_test = np.isin(np.arange(n), test)
    nx.draw_networkx_nodes(
        graph,
        pos,
        nodelist=np.flatnonzero(is_test).tolist(),
        node_color=colours[is_test].tolist(),
        ax=ax,
    )
    nx.draw_networkx_nodes(
        graph,
        pos,
        nodelist=train.tolist(),
        node_color=colours[train].tolist(),
        node_shape="s",
        edgecolors="k",
        linewidths=2,
        ax=ax,
    )
    if wrong:
        nx.draw_networkx_nodes(
            graph,
            pos,
            nodelist=wrong,
            node_color="none",
            edgecolors="C3",
            linewidths=2.5,
            node_size=500,
            ax=ax,
        )
    nx.draw_networkx_labels(graph, pos, font_size=7, ax=ax)
    handles = [
        plt.Line2D(
            [], [], ls="", marker="o", color="C0", label=f"predicted {CLUBS[0]}"
        ),
        plt.Line2D(
            [], [], ls="", marker="o", color="C1", label=f"predicted {CLUBS[1]}"
        ),
        plt.Line2D(
            [], [], ls="", marker="s", mfc="w", mec="k", mew=2, label="labelled"
        ),
        plt.Line2D(
            [], [], ls="", marker="o", mfc="none", mec="C3", mew=2, label="wrong"
        ),
    ]
    ax.legend(handles=handles, loc="lower left", fontsize=8)
    ax.set_title(
        f"Karate club, {2 * per_class} labelled nodes: accuracy {acc:.3f} on the rest"
    )
    ax.axis("off")
    fig.tight_layout()
    path = out / "karate_club.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    elapsed = time.perf_counter() - start
    print(f"figure saved to {path}; {elapsed:.1f} s")

    threshold = 0.7 if fast else 0.8
    assert acc >= threshold, f"accuracy {acc:.3f} < {threshold}"
    assert losses[-1] < 0.2 * losses[0], (losses[0], losses[-1])
    return {"accuracy": acc, "seconds": elapsed, "figure": str(path)}


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
