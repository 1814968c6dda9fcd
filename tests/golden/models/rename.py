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
    x = nn.Dense(4)(x)
    x = Block(name='encoder')(x)
    return nn.Dense(4)(x)
