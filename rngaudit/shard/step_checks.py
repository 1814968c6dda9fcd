"""The user's training step run as written (`shard-check --fn FILE.py:train_step --args FILE.py:factory`): the
factory builds its arguments (given the mesh when it asks for one), the step runs once with them, and every
random draw it makes is observed where it runs (observe.py). The device process returns the observation; the
command compares the devices and processes (step_analysis.py), which needs every process's."""

from __future__ import annotations

import inspect

from ..errors import UserCodeError
from ..usercode import CodeRef, first_line, load_callable, quiet_stdout
from .observe import Observation, axis_names, observing, watch_mapped_functions, watch_samplers


def _takes(fn, name: str) -> bool:
    """Whether `fn` takes a parameter called `name` (or **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1].lower() in "aeiou" else f"a {noun}"


def _factory_args(ref: CodeRef, mesh) -> tuple:
    factory = load_callable(ref, "--args", reuse=True)
    kwargs = {"mesh": mesh} if _takes(factory, "mesh") else {}
    try:
        with quiet_stdout():
            args = factory(**kwargs)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's factory failed: say so, in one line
        raise UserCodeError(f"--args {ref.text}: the factory raised {type(e).__name__}: {first_line(e)}") from None
    if not isinstance(args, (tuple, list)):
        raise UserCodeError(
            f"--args {ref.text}: the factory returned {_a(type(args).__name__)}; return the step's positional "
            "arguments as a tuple, e.g. return (state, batch, rng)"
        )
    return tuple(args)


def _bind_check(ref: CodeRef, fn, args: tuple, factory: CodeRef) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*args)
    except TypeError as e:
        raise UserCodeError(
            f"--fn {ref.text}: {ref.attr}{sig} cannot be called with the {len(args)} argument(s) --args "
            f"{factory.text} returned ({e})"
        ) from None


def data_axes_of(args: tuple) -> tuple[list[str], bool]:
    """(mesh axes that split an argument that is not a key, whether an argument spans several processes)."""
    import jax

    axes: list[str] = []
    spans = False
    for leaf in jax.tree_util.tree_leaves(args):
        if not isinstance(leaf, jax.Array):
            continue
        if not leaf.is_fully_addressable:
            spans = True
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            continue
        for name in axis_names(getattr(leaf.sharding, "spec", None)):
            if isinstance(name, str) and name not in axes:
                axes.append(name)
    return axes, spans


def observe_step(ref: CodeRef, factory: CodeRef, mesh) -> dict:
    """Run the step once on the factory's arguments and return what it drew (JSON data)."""
    import jax

    watch_mapped_functions()  # before the user's module is imported: its decorators make shard_maps, its
    watch_samplers()  # imports bind samplers
    fn = load_callable(ref, "--fn", reuse=True)
    args = _factory_args(factory, mesh)
    _bind_check(ref, fn, args, factory)
    axes, spans = data_axes_of(args)
    obs = Observation(jax.process_index())
    try:
        with observing(obs), quiet_stdout():
            out = fn(*args)
            jax.block_until_ready(out)
            jax.effects_barrier()
    except UserCodeError:
        raise
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's step failed: say so, in one line
        raise UserCodeError(f"--fn {ref.text}: the step raised {type(e).__name__}: {first_line(e)}") from None
    return {
        "fn": ref.text,
        "args": factory.text,
        "observation": obs.as_json(),
        "argument_axes": axes,
        "spans_processes": spans,
    }
