import flax.linen as nn
import jax
import jax.numpy as jnp

class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    y = nn.LayerNorm()(x)
    y = nn.MultiHeadDotProductAttention(num_heads=2, dropout_rate=0.1, deterministic=False)(y)
    x = x + nn.Dropout(0.1, deterministic=False)(y)
    y = nn.Dense(8)(nn.LayerNorm()(x))
    return x + nn.Dropout(0.1, deterministic=False)(y), None

class Encoder(nn.Module):
  @nn.compact
  def __call__(self, x):
    Stack = nn.scan(Block, variable_axes={'params': 0}, split_rngs={'params': True, 'dropout': True},
                    length=3)
    x, _ = Stack()(x, None)
    return x

def make():
  return Encoder(), (jnp.ones((2, 4, 8)),)
