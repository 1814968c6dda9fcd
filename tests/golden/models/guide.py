import flax.linen as nn
import jax
import jax.numpy as jnp

class Model(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(2, use_bias=False)(x)
    self.param('model_param', nn.initializers.lecun_normal(), (2, 2))
    self.variable('other_collection', 'model_variable1',
                  lambda: jax.random.normal(self.make_rng('params'), (2,)))
    self.variable('other_collection', 'model_variable2',
                  lambda: jax.random.normal(self.make_rng('other'), (2,)))
    return nn.Dense(2)(x)

class RNGSubSubModule(nn.Module):
  def __call__(self):
    return self.make_rng('rng_stream'), self.make_rng('rng_stream')

class RNGSubModule(nn.Module):
  @nn.compact
  def __call__(self):
    self.make_rng('rng_stream'); self.make_rng('rng_stream')
    RNGSubSubModule()()

class RNGModule(nn.Module):
  @nn.compact
  def __call__(self):
    self.make_rng('rng_stream'); self.make_rng('rng_stream')
    RNGSubModule()()

def model():
  return Model(), (jnp.ones((1, 2)),)

def submodules():
  return RNGModule()

def batch_dense():
  BatchDense = nn.vmap(nn.Dense, in_axes=0, out_axes=0, variable_axes={'params': 0},
                       split_rngs={'params': True})
  return BatchDense(2), (jnp.ones((3, 2)),)
