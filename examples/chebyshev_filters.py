r"""Chebyshev against monomial graph filters of order 12 on a band-pass task.

Both models are one polynomial graph filter of degree `ORDER` = 12, a learnable
linear map of 13 blocks of node features, and on this graph they can represent
exactly the same functions; they differ only in the basis of the polynomials:

- `krylovjax.nn.ChebGraphConv` (PyG's `ChebConv`) mixes $T_k(L - I) X$,
  $k = 0, \dots, 12$, with $L = I - D^{-1/2} A D^{-1/2}$ the normalised Laplacian
  (spectrum in $[0, 2]$) and $T_k$ the Chebyshev polynomials;
- `krylovjax.nn.KrylovGraphConv` (TAGConv) mixes the powers $\hat A^k X$ of the
  normalised adjacency with self-loops $\hat A = D^{-1/2}(A + I)D^{-1/2}$.

The graph is a 32 x 32 torus (a grid with wrap-around), 1024 nodes of degree 4.
Since it is regular, $\hat A = I - \tfrac45 L$, so the powers of $\hat A$ up to 12
span the same polynomials in $L$ as $T_0, \dots, T_{12}$.

The labels come from a known spectral filter of that degree: a band-pass response
$g$, the degree-12 Chebyshev interpolant of a Gaussian bump at $\lambda = 0.6$ of
width 0.2 (so both models can represent it exactly), applied to random node features
$X$ (4 per node) and mixed by a random $4 \times 3$ matrix; a node's class is the
largest of its 3 values. $g(L) X$ is computed with NumPy's FFT (the eigenvectors of a
torus are its Fourier modes), independently of krylovjax. Half the nodes are
labelled; the other half are predicted. A filter of low order cannot select the band:
a Chebyshev filter of degree 2, trained the same way, is printed as the reference.

All three start from zero weights (the same function) and are trained with the same
budget: Adam, the same learning rate, the same number of full-batch steps, on the
cross-entropy of the labelled nodes. The script
prints the loss and accuracies of each, asserts each model's own quality target,
and prints the condition numbers of the two bases, both of the polynomials (their
Gram matrix at Chebyshev points of the spectrum) and of the feature vectors on this
graph (singular values via NumPy). The models run in float32, JAX's default; the
labels and the Gram matrices are computed in float64 by NumPy. Nothing is downloaded.

Run with `python examples/chebyshev_filters.py` (no arguments; it saves no figure).
"""

import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.experimental import sparse

import krylovjax

SIDE = 32  # the torus is SIDE x SIDE nodes
DEGREE = 4  # every node of a torus has 4 neighbours
FEATURES = 4  # random input features per node
CLASSES = 3
ORDER = 12  # degree of every filter: ORDER + 1 polynomials
LOW_ORDER = 2  # degree of the reference filter
CENTRE, WIDTH = 0.6, 0.2  # the band-pass bump, in eigenvalues of L
LABELLED = 0.5  # fraction of the nodes whose class is known
STEPS, REPORT = 400, 100  # Adam steps; a progress line every REPORT steps
LEARNING_RATE = 5e-2


def torus_edges(side: int) -> np.ndarray:
    """The edges of the `side x side` torus, both directions of each, as an
    `(m, 2)` int32 array; node `i * side + j` sits in row `i`, column `j`."""
    n = side * side
    i, j = np.divmod(np.arange(n), side)
    nodes = np.arange(n)
    right = np.stack([nodes, i * side + (j + 1) % side], axis=1)
    down = np.stack([nodes, ((i + 1) % side) * side + j], axis=1)
    edges = np.concatenate([right, down])
    return np.concatenate([edges, edges[:, ::-1]]).astype(np.int32)


def bcoo(indices: np.ndarray, data: np.ndarray, n: int) -> sparse.BCOO:
    """An `(n, n)` float32 BCOO matrix from NumPy indices and values."""
    data = jnp.asarray(data, dtype=jnp.float32)
    return sparse.BCOO((data, jnp.asarray(indices)), shape=(n, n))


def band_pass() -> np.polynomial.Chebyshev:
    """The target response $g(\\lambda)$, a polynomial of degree `ORDER` on
    $[0, 2]$."""
    return np.polynomial.Chebyshev.interpolate(
        lambda lam: np.exp(-(((lam - CENTRE) / WIDTH) ** 2)), ORDER, domain=[0, 2]
    )


def make_task(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random features `X` (n, FEATURES) and the classes `argmax(g(L) X W)`.

    $L = I - A / 4$ on the torus is diagonalised by the two-dimensional Fourier
    transform, with eigenvalue $1 - (\\cos\\theta_1 + \\cos\\theta_2) / 2$ for the
    mode of frequencies $(\\theta_1, \\theta_2)$, so $g(L) X$ is an FFT, a product
    and an inverse FFT, in float64.
    """
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((SIDE, SIDE, FEATURES))
    mix = rng.standard_normal((FEATURES, CLASSES))
    theta = 2 * np.pi * np.fft.fftfreq(SIDE)
    lam = 1 - (np.cos(theta)[:, None] + np.cos(theta)[None, :]) / 2
    filtered = np.fft.ifft2(
        band_pass()(lam)[:, :, None] * np.fft.fft2(X, axes=(0, 1)), axes=(0, 1)
    ).real
    labels = np.argmax(filtered.reshape(-1, FEATURES) @ mix, axis=1)
    return X.reshape(-1, FEATURES).astype(np.float32), labels


def train(name, model, graph, X, labels, train_idx, test_idx) -> dict:
    """Full-batch Adam on the labelled nodes for `STEPS` steps, as one jitted
    program; prints every `REPORT`-th step and returns the final numbers.

    The step `i` of the scan computes the logits of every node for the loss, and
    the accuracies from the same logits: they are those of the model after `i`
    updates. The scan runs `STEPS + 1` steps so that its last one measures the model
    after `STEPS` updates (its own update is not used).
    """
    optim = optax.adam(LEARNING_RATE)
    y = jnp.asarray(labels)
    train_idx, test_idx = jnp.asarray(train_idx), jnp.asarray(test_idx)

    def loss_fn(model):
        logits = model(graph, X)
        loss = optax.softmax_cross_entropy_with_integer_labels(
            logits[train_idx], y[train_idx]
        ).mean()
        predicted = jnp.argmax(logits, axis=-1)
        accuracies = (
            jnp.mean(predicted[train_idx] == y[train_idx]),
            jnp.mean(predicted[test_idx] == y[test_idx]),
        )
        return loss, accuracies

    def step(carry, _):
        model, opt_state = carry
        (loss, accuracies), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
            model
        )
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optim.update(grads, opt_state, params)
        return (eqx.apply_updates(model, updates), opt_state), (loss, *accuracies)

    @eqx.filter_jit
    def fit(model):
        opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
        _, history = jax.lax.scan(step, (model, opt_state), None, length=STEPS + 1)
        return history

    print(f"{name}:", flush=True)
    losses, train_acc, test_acc = (np.asarray(h) for h in fit(model))
    for i in range(REPORT, STEPS + 1, REPORT):
        print(
            f"  step {i:4d}  train loss {losses[i]:.4f}  train accuracy "
            f"{train_acc[i]:.3f}  test accuracy {test_acc[i]:.3f}",
            flush=True,
        )
    return {
        "loss": float(losses[-1]),
        "train_accuracy": float(train_acc[-1]),
        "accuracy": float(test_acc[-1]),
    }


def zero_layer(layer, order: int) -> eqx.Module:
    """`layer(FEATURES, CLASSES, order)` with every weight and bias 0.

    Every model starts from the same function (all logits 0), so the models differ
    only in their basis; and no random draw is compiled (`eqx.filter_eval_shape`
    gives the shapes without running the initialisation).
    """
    shapes = eqx.filter_eval_shape(layer, FEATURES, CLASSES, order, key=jr.key(0))
    return jax.tree.map(lambda s: jnp.asarray(np.zeros(s.shape, s.dtype)), shapes)


def gram_condition(basis: str) -> float:
    """The condition number of the Gram matrix of a basis's `ORDER + 1` polynomials
    at `2 (ORDER + 1)` Chebyshev points of the spectrum of $L$, $[0, 2]$, in float64:
    how well a filter's coefficients are determined by its response."""
    d = ORDER + 1
    lam = 1 + np.cos(np.pi * (np.arange(2 * d) + 0.5) / (2 * d))
    if basis == "Chebyshev":  # T_k(L - I)
        V = np.polynomial.chebyshev.chebvander(lam - 1, d - 1)
    else:  # the powers of A_hat = I - 4/5 L, whose eigenvalues are 1 - 4/5 lam
        V = np.vander(1 - DEGREE / (DEGREE + 1) * lam, d, increasing=True)
    return float(np.linalg.cond(V.T @ V))


def vector_condition(blocks: jax.Array) -> float:
    """The condition number of the (n, (ORDER + 1) FEATURES) matrix of feature
    vectors a layer mixes, each column scaled to norm 1 (float32 vectors, singular
    values in float64)."""
    V = np.asarray(blocks, dtype=np.float64).reshape(blocks.shape[0], -1)
    s = np.linalg.svd(V / np.linalg.norm(V, axis=0), compute_uv=False)
    return float(s[0] / s[-1])


def main(seed: int = 0) -> dict:
    start = time.perf_counter()
    n = SIDE * SIDE
    edges = torus_edges(SIDE)
    adjacency = bcoo(edges, np.ones(len(edges)), n)
    a_hat = jax.jit(krylovjax.nn.normalise_adjacency)(adjacency)
    # L = I - A / 4, the Laplacian ChebGraphConv builds from `adjacency` (L^T = L).
    diagonal = np.stack([np.arange(n), np.arange(n)], axis=1).astype(np.int32)
    laplacian = bcoo(
        np.concatenate([edges, diagonal]),
        np.concatenate([np.full(len(edges), -1 / DEGREE), np.ones(n)]),
        n,
    )
    X_np, labels = make_task(seed)
    X = jnp.asarray(X_np)
    rng = np.random.default_rng(seed + 1)
    order = rng.permutation(n)
    train_idx = np.sort(order[: int(LABELLED * n)])
    test_idx = np.sort(order[int(LABELLED * n) :])
    print(
        f"{SIDE} x {SIDE} torus, {n} nodes; band-pass of degree {ORDER} at "
        f"lambda = {CENTRE} (width {WIDTH}); classes {np.bincount(labels).tolist()}; "
        f"{len(train_idx)} labelled, {len(test_idx)} to predict",
        flush=True,
    )

    data = (X, labels, train_idx, test_idx)

    cheb_model = zero_layer(krylovjax.nn.ChebGraphConv, ORDER + 1)
    mono_model = zero_layer(krylovjax.nn.KrylovGraphConv, ORDER)
    low_model = zero_layer(krylovjax.nn.ChebGraphConv, LOW_ORDER + 1)
    cheb = train(
        f"Chebyshev, ChebGraphConv(K={ORDER + 1}) on A", cheb_model, adjacency, *data
    )
    mono = train(
        f"monomial, KrylovGraphConv(num_hops={ORDER}) on A_hat",
        mono_model,
        a_hat,
        *data,
    )
    low = train(
        f"reference: Chebyshev of degree {LOW_ORDER}, ChebGraphConv(K={LOW_ORDER + 1})",
        low_model,
        adjacency,
        *data,
    )

    # The blocks each layer mixes: T_k(L - I) X and A_hat^k X, in one program.
    @jax.jit
    def feature_blocks(laplacian, a_hat, X):
        basis = krylovjax.Chebyshev(0.0, 2.0)
        return {
            "Chebyshev": krylovjax.krylov(
                laplacian, X, ORDER + 1, basis=basis, layout="columns"
            ),
            "monomial": krylovjax.krylov(a_hat, X, ORDER + 1, layout="columns"),
        }

    blocks = feature_blocks(laplacian, a_hat, X)
    results = {"Chebyshev": cheb, "monomial": mono}
    print(
        f"\nbasis      test accuracy  train loss  cond(Gram, {2 * (ORDER + 1)} points)"
        f"  cond(vectors, {n} x {(ORDER + 1) * FEATURES})"
    )
    for name, result in results.items():
        result["gram_cond"] = gram_condition(name)
        result["vector_cond"] = vector_condition(blocks[name])
        print(
            f"{name:<10} {result['accuracy']:13.3f}  {result['loss']:10.4f}  "
            f"{result['gram_cond']:22.3g}  {result['vector_cond']:22.3g}"
        )
    print(
        f"{'degree ' + str(LOW_ORDER):<10} {low['accuracy']:13.3f}  {low['loss']:10.4f}"
    )
    elapsed = time.perf_counter() - start
    print(f"{elapsed:.1f} s")

    # Each model's own target, cleared with a margin on every seed measured. Test
    # accuracy over seeds 0-7 (`main(seed)` of this script, CPU, float32):
    # Chebyshev 0.873-0.930 (mean 0.91), monomial 0.738-0.832 (mean 0.78), degree 2
    # 0.582-0.637; the largest class is about 0.37 of the nodes. The margins leave
    # room for other platforms' float32 rounding, and are not tuned to the gap: the
    # monomial target is its own, and no assertion compares the two bases.
    assert cheb["accuracy"] >= 0.85, f"Chebyshev accuracy {cheb['accuracy']:.3f}"
    assert mono["accuracy"] >= 0.7, f"monomial accuracy {mono['accuracy']:.3f}"
    # The claim that the order matters: a degree-2 filter cannot select the band.
    assert low["accuracy"] <= 0.7, f"degree-2 accuracy {low['accuracy']:.3f}"
    return {"chebyshev": cheb, "monomial": mono, "low_order": low, "seconds": elapsed}


if __name__ == "__main__":
    main()
