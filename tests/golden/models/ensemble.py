import flax.linen as nn
import jax
import jax.numpy as jnp

class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(4)(x)
    x = nn.Dropout(0.5, deterministic=False)(x)
    return nn.Dense(4)(x)

def make():
  return Model(), (jnp.ones((1, 4)),)

class Model(nn.Module):
  @nn.compact
  def __call__(self, x):
    E = nn.vmap(Block, variable_axes={'params': 0}, split_rngs={'params': True, 'dropout': True},
                in_axes=None, out_axes=0, axis_size=3)
    return E()(x)
