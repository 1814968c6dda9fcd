import flax.linen as nn
import jax
import jax.numpy as jnp

class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(4)(x)
    x = nn.Dropout(0.5, deterministic=False)(x)
    return nn.Dense(1)(x)

class Ensemble(nn.Module):
  @nn.compact
  def __call__(self, x):
    E = nn.vmap(MLP, variable_axes={'params': 0}, split_rngs={'params': True, 'dropout': True},
                in_axes=None, out_axes=0, axis_size=3)
    return E()(x)

def make():
  return Ensemble(), (jnp.ones((2, 4)),)
