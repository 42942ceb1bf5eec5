"""Test configuration: float64 for gradient checks, modest hypothesis profile."""

import jax
from hypothesis import settings

jax.config.update("jax_enable_x64", True)

settings.register_profile("krylovjax", max_examples=20, deadline=None)
settings.load_profile("krylovjax")
