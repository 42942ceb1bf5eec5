"""Quickstart: build a Krylov matrix, differentiate it, and check the gradient of x0.

Run with `python examples/quickstart.py`; it finishes in a few seconds.
"""

import jax
import jax.numpy as jnp

import krylovjax


def main() -> dict[str, jax.Array]:
    jnp.set_printoptions(precision=4, suppress=True)
    key_a, key_x = jax.random.split(jax.random.key(0))
    n, d = 3, 10
    A = 0.5 * jax.random.normal(key_a, (n, n))
    x0 = jax.random.normal(key_x, (n,))

    # X = [x0, A x0, ..., A^(d-1) x0], one column per vector.
    X = krylovjax.krylov(A, x0, d)
    print(f"Krylov matrix, shape {X.shape}:\n{X}\n")

    # Gradients of a scalar loss with respect to both the operator and x0.
    def loss(A, x0):
        return jnp.sum(krylovjax.krylov(A, x0, d))

    grad_A, grad_x0 = jax.jit(jax.grad(loss, argnums=(0, 1)))(A, x0)
    print(f"d loss / d A:\n{grad_A}\n")
    print(f"d loss / d x0: {grad_x0}\n")

    # For this loss the gradient of x0 has a closed form: sum_k (A^T)^k 1.
    expected = sum(jnp.linalg.matrix_power(A.T, k) @ jnp.ones(n) for k in range(d))
    error = float(jnp.max(jnp.abs(grad_x0 - expected)))
    print(f"max |d loss / d x0 - sum_k (A^T)^k 1| = {error:.2e}")
    assert error < 1e-4 * float(jnp.max(jnp.abs(expected))), error
    return {"X": X, "grad_A": grad_A, "grad_x0": grad_x0}


if __name__ == "__main__":
    main()
