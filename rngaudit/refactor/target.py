"""capture's TARGET and options: `FILE.py:FACTORY` or `package.module:FACTORY` parsed and the user's module built
(with its example arguments, or --input ones), and --rngs parsed."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UsageError, UserCodeError
from ..usercode import CodeRef, load, parse_code_ref

_DTYPES = {
    "f32": "float32",
    "f16": "float16",
    "bf16": "bfloat16",
    "f64": "float64",
    "i32": "int32",
    "i64": "int64",
    "u32": "uint32",
    "i8": "int8",
    "u8": "uint8",
    "bool": "bool",
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "int32": "int32",
}
_IDENT = r"[A-Za-z_]\w*"


@dataclass(frozen=True)
class InputSpec:
    """One argument of init/apply: `f32[4,8]` (ones of that shape), positional or `name=`."""

    name: str | None
    dtype: str
    shape: tuple[int, ...]
    text: str


def parse_step(text: str) -> CodeRef:
    """--step FILE.py:NAME (an NNX model's training step)."""
    return parse_code_ref(text, "--step", "NAME", "train_step")


def parse_target(text: str) -> CodeRef:
    """`path/to/file.py:make_model` or `package.module:make_model`."""
    return parse_code_ref(text, "TARGET", "FACTORY", "make_model")


def parse_input(text: str) -> InputSpec:
    """`f32[4,8]`, `x=f32[4,8]`, `i32[2]`, `f32[]`."""
    m = re.fullmatch(rf"\s*(?:({_IDENT})\s*=\s*)?(\w+)\[([\d,\s]*)\]\s*", text)
    if not m or m.group(2) not in _DTYPES:
        raise UsageError(
            f"--input {text!r}: write DTYPE[SHAPE], optionally NAME=DTYPE[SHAPE], e.g. f32[4,8] or "
            f"x=i32[2,16] (dtypes: f32, f16, bf16, i32, i64, bool)"
        )
    dims = tuple(int(d) for d in m.group(3).split(",") if d.strip())
    return InputSpec(m.group(1), _DTYPES[m.group(2)], dims, text)


def parse_rngs(text: str | None) -> dict[str, int]:
    """`params=0,dropout=1` -> {stream: seed}; default {params: 0}."""
    if text is None:
        return {"params": 0}
    out: dict[str, int] = {}
    for part in text.split(","):
        name, eq, seed = part.partition("=")
        name, seed = name.strip(), seed.strip()
        if not eq or not name or not re.fullmatch(r"-?\d+", seed):
            raise UsageError(
                f"--rngs {text!r}: write STREAM=SEED,..., e.g. params=0,dropout=1 (an NNX model's nnx.Rngs(0) is "
                "default=0)"
            )
        if name in out:
            raise UsageError(f"--rngs {text!r}: stream {name!r} is given twice")
        out[name] = int(seed)
        if not -(2**63) <= out[name] < 2**63:
            raise UsageError(f"--rngs {text!r}: seeds are signed 64-bit integers")
    return out


def unpack_made(made, module_type: type, target: CodeRef, called: str, what: str) -> tuple:
    """What a factory returned: a module, or (module, args) / (module, args, kwargs) -> (module, args, kwargs)."""
    args: tuple | list = ()
    kwargs: dict = {}
    if isinstance(made, tuple) and made and isinstance(made[0], module_type) and len(made) in (2, 3):
        module, args = made[0], made[1]
        kwargs = made[2] if len(made) == 3 else {}
        if not isinstance(args, (tuple, list)):
            args = (args,)
        if not isinstance(kwargs, dict):
            raise UserCodeError(
                f"TARGET {target.text}: the third value the factory returns must be a dict of keyword arguments"
            )
    elif isinstance(made, tuple) and made and isinstance(made[0], module_type):
        raise UserCodeError(
            f"TARGET {target.text}: {target.attr}{called} returned a tuple of {len(made)} values; return the module, "
            "(module, args) or (module, args, kwargs)"
        )
    else:
        module = made
    if not isinstance(module, module_type):
        first = module[0] if isinstance(module, tuple) and module else module
        mro = [k.__module__ for k in type(first).__mro__]
        if "nnx" in what and any(m.startswith("flax.linen") for m in mro):
            raise UserCodeError(
                f"TARGET {target.text}: {target.attr}{called} returned a Linen module ({type(first).__name__}), and "
                "the spec is an NNX spec: give the factory of the NNX model it describes (or verify a Linen spec "
                "against this one)"
            )
        if any(m.startswith("flax.nnx") for m in mro):
            raise NnxModelError(
                f"TARGET {target.text}: {target.attr}{called} returned an NNX model: an NNX factory takes the "
                "nnx.Rngs it builds the model from (def make_model(rngs): return Model(rngs=rngs)), so capture sees "
                "its construction"
            )
        raise UserCodeError(
            f"TARGET {target.text}: {target.attr}{called} returned a {type(module).__name__}, not {what} "
            "(return the module, or (module, args))"
        )
    return module, tuple(args), dict(kwargs)


class NnxModelError(UserCodeError):
    """A Linen TARGET (a factory without parameters) that returned an NNX model."""


class FactoryError(UserCodeError):
    """A TARGET function without parameters that raises when called (whichever model it would build)."""


def build_module(target: CodeRef, inputs: list[InputSpec]):
    """The module and its example arguments: the factory may return a Module, or (module, args) or
    (module, args, kwargs); --input overrides the example arguments."""
    import flax.linen as nn

    factory = load(target, "TARGET")
    if isinstance(factory, nn.Module):
        made = factory
    elif isinstance(factory, type) and issubclass(factory, nn.Module):
        try:
            made = factory()
        except Exception as e:  # noqa: BLE001
            raise UserCodeError(
                f"TARGET {target.text}: {factory.__name__}() without arguments raises "
                f"{type(e).__name__}: {e}; point TARGET at a function that builds it"
            ) from None
    elif callable(factory):
        try:
            made = factory()
        except Exception as e:  # noqa: BLE001
            raise FactoryError(
                f"TARGET {target.text}: calling {target.attr}() raises {type(e).__name__}: {e}"
            ) from None
    else:
        raise UserCodeError(
            f"TARGET {target.text}: {target.attr} is a {type(factory).__name__}, not a Flax "
            "module or a function returning one"
        )
    module, args, kwargs = unpack_made(made, nn.Module, target, "()", "a flax.linen Module")
    if inputs:
        from .nnx_capture import example_inputs

        args, kwargs = example_inputs(inputs)
    return module, tuple(args), dict(kwargs)
