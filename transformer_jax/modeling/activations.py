"""The feed-forward activations by name (config.ACTIVATIONS; for the gated variants, the gate's)."""

from __future__ import annotations

import jax

_FUNCTIONS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
    "swiglu": jax.nn.silu,
    "geglu": lambda x: jax.nn.gelu(x, approximate=True),
    "none": lambda x: x,
}


def activation_fn(name: str):
    """The activation called `name`: 'relu', 'gelu' (exact), 'gelu_tanh', 'silu', 'swiglu' /
    'geglu' (their gates: SiLU / tanh-GELU) or 'none'."""
    if name not in _FUNCTIONS:
        raise ValueError(f"activation must be one of {sorted(_FUNCTIONS)}, got {name!r}")
    return _FUNCTIONS[name]
