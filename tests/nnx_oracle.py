"""The NNX oracle: builds an NNX spec's model in real Flax NNX, constructs it and calls it `steps` times, and
records every key an RngStream hands out (its tag, the count it folded in, the key data), in order.

Keys are observed, never replaced: `nnx.RngStream.__call__` is wrapped to read the count before the call and
the key it returned. The builder knows which statement runs, so each key also carries its site (the module
path and the attribute being built or called), to compare with derive's `site` up to the layer (derive names
the parameter inside a layer too: `linear.kernel`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax_oracle import draw_fn, eval_key, key_words

from rngaudit.engine.nnx import run_draw_steps
from rngaudit.spec.nnx import (
    NnxBidirectional,
    NnxBridge,
    NnxCall,
    NnxChild,
    NnxCond,
    NnxDraw,
    NnxLayer,
    NnxLoop,
    NnxMode,
    NnxModule,
    NnxReseed,
    NnxRnn,
    NnxRunDraw,
    NnxSpec,
    NnxStreamFork,
    NnxTransform,
    nested,
)


@contextlib.contextmanager
def nnx_settings(spec: NnxSpec):
    saved = (jax.config.jax_threefry_partitionable, jax.config.jax_default_prng_impl)
    jax.config.update("jax_threefry_partitionable", spec.threefry_partitionable)
    jax.config.update("jax_default_prng_impl", spec.prng_impl)
    try:
        yield
    finally:
        jax.config.update("jax_threefry_partitionable", saved[0])
        jax.config.update("jax_default_prng_impl", saved[1])


def _tag(stream) -> str:
    """A stream's tag (flax < 0.11 keeps it on the key variable only)."""
    tag = getattr(stream, "tag", None)
    return tag if tag is not None else stream.key.tag


class _Recorder:
    def __init__(self):
        self.records: list[dict] = []
        self.site = ""
        self.step = 0
        self.off = False
        self.linen = None  # (flax_oracle's _Capture, _Builder): the Linen keys of bridge.ToNNX modules
        self.draw = None  # the `draw:` of the statement drawing now, if any
        self.bridges: dict[int, object] = {}  # id(a ToNNX's Linen module) -> its ModuleDef
        self.call_rngs = None  # the spec's `call_rngs:`: the nnx.Rngs every call of the model is given
        self.model_rngs = None  # the nnx.Rngs the model is built from (`rngs: model`)

    def linen_builder(self):
        """The Linen side of the oracle (flax_oracle's hooks on Scope.make_rng etc.), installed on first use."""
        if self.linen is None:
            from flax_oracle import _Builder, _Capture, _hooks

            cap = _Capture()
            self._linen_hooks = _hooks(cap)
            self._linen_hooks.__enter__()
            cap.recording = True
            self.linen = (cap, _Builder(cap))
        return self.linen[1]

    def linen_records(self) -> list[dict]:
        if self.linen is None:
            return []
        jax.effects_barrier()
        return self.linen[0].records()

    def close(self) -> None:
        if self.linen is not None:
            self.linen[0].recording = False
            self._linen_hooks.__exit__(None, None, None)

    @contextlib.contextmanager
    def installed(self):
        original = nnx.RngStream.__call__
        rec = self

        def call(stream):
            count = stream.count[...]
            key = original(stream)
            # a spec's `draw:` statement: the values the model draws from the key, where it draws them (in an
            # nnx.vmap lane, as jax.vmap computes them)
            value = draw_fn(rec.draw)(key) if rec.draw is not None else None
            traced = isinstance(count, jax.core.Tracer) or isinstance(jax.random.key_data(key), jax.core.Tracer)
            if traced:  # inside a jitted step or a transform: recorded when it runs
                step, site, tag = rec.step, rec.site, _tag(stream)

                def record(c, k, v=None):
                    words = tuple(int(w) for w in np.asarray(k).ravel())
                    rec.records.append({"step": step, "site": site, "tag": tag, "count": int(c), "key": words})
                    if v is not None:
                        rec.records[-1]["value"] = np.asarray(v)

                jax.debug.callback(
                    record, count, jax.random.key_data(key), *(() if value is None else (value,)), ordered=True
                )
            elif not rec.off:
                rec.records.append(
                    {
                        "step": rec.step,
                        "site": rec.site,
                        "tag": _tag(stream),
                        "count": int(count),
                        "key": key_words(key),
                        **({} if value is None else {"value": np.asarray(value)}),
                    }
                )
            return key

        nnx.RngStream.__call__ = call
        try:
            yield self
        finally:
            nnx.RngStream.__call__ = original
            self.close()


def _layer(st: NnxLayer, rngs):
    o = dict(st.options)
    k = st.kind
    if k == "Linear":
        return nnx.Linear(2, 3, use_bias=o["use_bias"], rngs=rngs)
    if k == "LinearGeneral":
        return nnx.LinearGeneral(2, 3, use_bias=o["use_bias"], rngs=rngs)
    if k == "Conv":
        return nnx.Conv(2, 3, kernel_size=(2,), use_bias=o["use_bias"], rngs=rngs)
    if k == "ConvTranspose":
        return nnx.ConvTranspose(2, 3, kernel_size=(2,), use_bias=o["use_bias"], rngs=rngs)
    if k == "Embed":
        return nnx.Embed(5, 3, rngs=rngs)
    if k in ("LayerNorm", "BatchNorm", "InstanceNorm"):
        return getattr(nnx, k)(4, use_scale=o["use_scale"], use_bias=o["use_bias"], rngs=rngs)
    if k == "GroupNorm":
        return nnx.GroupNorm(4, num_groups=2, use_scale=o["use_scale"], use_bias=o["use_bias"], rngs=rngs)
    if k == "RMSNorm":
        return nnx.RMSNorm(4, use_scale=o["use_scale"], rngs=rngs)
    if k == "Dropout":
        return nnx.Dropout(
            o["rate"],
            rng_collection=o["rng_collection"],
            deterministic=o["deterministic"],
            rngs=rngs if o["rngs"] else None,
        )
    if k == "MultiHeadAttention":
        import inspect

        # (keep_rngs is flax >= 0.11's: older specs leave it at its default)
        keep = (
            {"keep_rngs": o["keep_rngs"]}
            if "keep_rngs" in inspect.signature(nnx.MultiHeadAttention.__init__).parameters
            else {}
        )
        return nnx.MultiHeadAttention(
            num_heads=1,
            in_features=2,
            qkv_features=2,
            use_bias=o["use_bias"],
            normalize_qk=o["normalize_qk"],
            dropout_rate=o["dropout_rate"],
            deterministic=o["deterministic"],
            decode=False,
            rngs=rngs,
            **keep,
        )
    if k == "LoRALinear":
        return nnx.LoRALinear(2, 3, lora_rank=1, use_bias=o["use_bias"], rngs=rngs)
    if k == "LoRA":
        base = None if st.base is None else _layer(st.base, rngs)  # (an argument: built first)
        return nnx.LoRA(2, 1, 3, base_module=base, rngs=rngs)
    if k in ("LSTMCell", "OptimizedLSTMCell", "GRUCell", "SimpleCell"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (keep_rngs is deprecated)
            return getattr(nnx, k)(2, 3, keep_rngs=o["keep_rngs"], rngs=rngs)
    raise AssertionError(k)


def _cell_class(st: NnxChild, rec, path: str, cache: dict, carry_draws: int):
    """A user cell (an nnx.RNNCellBase): its __init__ and call statements as _class builds them, called with
    (carry, x); its initialize_carry draws `carry_draws` keys from the stream it is given."""
    base = _class(st.module, rec, path, cache)

    def __call__(self, carry, x):
        self.oracle_run(st.module.call, x)
        return carry, x

    def initialize_carry(self, input_shape, rngs=None):
        if rngs is None:
            rngs = getattr(self, "rngs", None)
        if isinstance(rngs, nnx.Rngs):
            rngs = rngs.carry
        if rngs is None and carry_draws:
            raise ValueError("RNGs must be provided to initialize the cell carry.")  # (as NNX's cells raise)
        site, rec.site = rec.site, path + ".initialize_carry"
        for _ in range(carry_draws):
            rngs()
        rec.site = site
        return jnp.zeros(input_shape)

    return type(
        st.module.cls,
        (base, nnx.RNNCellBase),
        {"__call__": __call__, "initialize_carry": initialize_carry, "num_feature_axes": property(lambda self: 1)},
    )


def _rnn(st: NnxRnn, rec, path: str, cache: dict, rngs):
    """nnx.RNN(cell, rngs=..., broadcast_rngs=...), the cell built first."""
    rec.site = path + ".cell"
    if isinstance(st.cell, NnxLayer):
        cell = _layer(st.cell, rngs)
    else:
        child_rngs = rngs.fork() if st.cell.rngs == "fork" else None if st.cell.rngs == "none" else rngs
        cell = _cell_class(st.cell, rec, path + ".cell", cache, st.carry_draws)(child_rngs)
    rec.site = path
    given = {"own": True, "fork": rngs, "none": False}[st.rngs]
    return nnx.RNN(cell, rngs=given, broadcast_rngs=_tags(st.broadcast) if st.broadcast else None)


def _bidirectional(st: NnxBidirectional, rec, path: str, cache: dict, rngs):
    """nnx.Bidirectional(forward_rnn, backward_rnn, rngs=...), the RNNs built first."""
    fwd = _rnn(st.forward, rec, path + ".forward_rnn", cache, rngs)
    bwd = _rnn(st.backward, rec, path + ".backward_rnn", cache, rngs)
    rec.site = path
    return nnx.Bidirectional(fwd, bwd, rngs={"own": True, "fork": rngs, "none": False}[st.rngs])


def _zero_carry(cell):
    user = not type(cell).__module__.startswith("flax")
    zero = jnp.zeros((1, 2 if user else 3))
    return (zero, zero) if isinstance(cell, (nnx.LSTMCell, nnx.OptimizedLSTMCell)) else zero


def _rnn_call(st: NnxCall, rnn, rec) -> None:
    """rnn(x) over a sequence of `length` steps (with `initial_carry=` zeros, or `rngs=` the Rngs given)."""
    kw: dict = {}
    if st.initial_carry and isinstance(rnn, nnx.Bidirectional):
        kw["initial_carry"] = (_zero_carry(rnn.forward_rnn.cell), _zero_carry(rnn.backward_rnn.cell))
    elif st.initial_carry:
        kw["initial_carry"] = _zero_carry(rnn.cell)
    if st.given_rngs:
        kw["rngs"] = rec.call_rngs if st.given_rngs == "call" else rec.model_rngs
    rnn(jnp.ones((1, st.length, 2)), **kw)
    barrier(jnp.ones(()))


class _Items(nnx.Module):
    """What an nnx.List is to graph order: items held as attributes "0", "1", ... walked by their index."""

    _pytree__has_int_keys = True


def _nest(module) -> None:
    """A spec's dotted layer names (`blocks.0`, `head.layers.2`: what capture writes for the items of an nnx.List
    or Sequential), built first as attributes of those names, moved into the containers real NNX has: `blocks` an
    nnx.List-like `_Items` holding "0", "1", ..., so nnx.graph walks `blocks.2` before `blocks.10` as it does a
    real model's (a name whose head is a layer of its own is left where it is)."""
    for name in [a for a in vars(module) if "." in a]:
        parts = name.split(".")
        holder, fits = module, True
        for part in parts[:-1]:
            holder = vars(holder).get(part)
            if holder is None:
                break
            if not isinstance(holder, (_Items, _Holder)):
                fits = False
                break
        if not fits:
            continue
        value = getattr(module, name)
        delattr(module, name)
        holder = module
        for part, after in itertools.pairwise(parts):
            if part not in vars(holder):
                setattr(holder, part, _Items() if after.isdigit() else _Holder())
            holder = getattr(holder, part)
        setattr(holder, parts[-1], value)


class _Holder(nnx.Module):
    """A module holding what a dotted name puts under it (`head` of `head.layers.2`)."""


def _attribute(obj, name: str):
    """obj.<name>, or (a dotted spec name, `enc.drop`) a submodule's attribute: self.enc.drop."""
    if hasattr(obj, name):
        return getattr(obj, name)
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        head = getattr(obj, ".".join(parts[:i]), None)
        if isinstance(head, nnx.Module):
            try:
                return _attribute(head, ".".join(parts[i:]))
            except AttributeError:
                continue
    raise AttributeError(name)


def _class(mod: NnxModule, rec: _Recorder, path: str, cache: dict):
    def join(name: str) -> str:
        return f"{path}.{name}" if path else name

    def __init__(self, rngs):
        for st in mod.init:
            if isinstance(st, NnxLayer):
                rec.site = join(st.name)
                setattr(self, st.name, _layer(st, rngs))
            elif isinstance(st, NnxChild) and st.stack:
                rec.site = join(st.name)
                cls = _class(st.module, rec, join(st.name), cache)
                if st.rngs == "shared":
                    setattr(self, st.name, _stacked(cls, st.stack)(rngs))
                else:
                    setattr(self, st.name, _stacked_from(cls, st, rngs))
            elif isinstance(st, NnxChild):
                rec.site = join(st.name)
                child_rngs = rngs.fork() if st.rngs == "fork" else None if st.rngs == "none" else rngs
                setattr(self, st.name, _class(st.module, rec, join(st.name), cache)(child_rngs))
            elif isinstance(st, NnxRnn):
                setattr(self, st.name, _rnn(st, rec, join(st.name), cache, rngs))
            elif isinstance(st, NnxBidirectional):
                setattr(self, st.name, _bidirectional(st, rec, join(st.name), cache, rngs))
            elif isinstance(st, NnxBridge):
                from flax.nnx import bridge

                rec.site = join(st.name)
                builder = rec.linen_builder()
                linen = builder.construct(st.module, None)
                m = bridge.ToNNX(linen, rngs=rngs if st.rngs == "fork" else rngs.params())
                rec.bridges[id(linen)] = st.module  # (the Linen module object survives split/merge)
                setattr(self, st.name, m)
                if st.lazy_init:
                    builder.phase = "init"
                    rec.site = join(st.name) + ".to_nnx__rngs"
                    bridge.lazy_init(m, builder.input_for(st.module))
            elif isinstance(st, NnxDraw):
                for _ in range(st.repeat):
                    rec.site = path or "(root)"
                    rec.draw = st.draw
                    try:
                        getattr(rngs, st.stream)()
                    finally:
                        rec.draw = None
            elif isinstance(st, NnxStreamFork):
                rec.site = join(st.name)  # (the fork's draws, as a Dropout's, are at its attribute)
                setattr(self, st.name, getattr(rngs, st.stream).fork())
        _nest(self)
        if mod.keep_rngs:
            self.rngs = rngs
        if _has_when(mod.call):
            self.deterministic = False  # (model.train()/eval() set it: `when:` draws follow it)

    def __call__(self, x):
        run(self, mod.call, x)
        return x

    def run(self, statements, x):
        """The statements on `self` (the module, or the copy nnx.cond / a loop hands its function)."""
        for st in statements:
            if isinstance(st, (NnxDraw, NnxCall)) and st.when and bool(self.deterministic) != (st.when == "eval"):
                continue  # (if not self.deterministic: ..., or `if self.deterministic:` for `when: eval`)
            if isinstance(st, NnxCond):
                # nnx.cond(pred, true_fun, false_fun, self, x) / nnx.switch(index, branches, self, x), the
                # module and the input passed as operands (what NNX carries through the branch)
                fns = [lambda m, h, b=b: (run(m, b, h), h)[1] for b in st.branches]
                if st.kind == "cond":
                    nnx.cond(st.given, fns[0], fns[1], self, x)
                else:
                    nnx.switch(st.given, fns, self, x)
                barrier(x)
            elif isinstance(st, NnxLoop):
                if st.kind == "fori_loop":

                    def body(i, carry, st=st):
                        m, h = carry
                        run(m, st.body, h)
                        return m, h

                    nnx.fori_loop(0, st.iterations, body, (self, x))
                else:

                    def wbody(carry, st=st):
                        m, i, h = carry
                        run(m, st.body, h)
                        return m, i + 1, h

                    nnx.while_loop(lambda c, n=st.iterations: c[1] < n, wbody, (self, jnp.asarray(0), x))
                barrier(x)
            elif isinstance(st, NnxCall) and st.fork is not None:
                # with nnx.fork_rngs(self.<name>, split={tags: None}): self.<name>(x)
                one = dataclasses.replace(st, repeat=1, fork=None)
                for _ in range(st.repeat):
                    rec.site = join(st.name)
                    with nnx.fork_rngs(_attribute(self, st.name), split={_tags(st.fork) if st.fork else ...: None}):
                        run(self, (one,), x)
            elif isinstance(st, NnxCall):
                target = _attribute(self, st.name)
                # drop(x, deterministic=...): the call's argument wins over the layer's attribute
                given_mode = {} if st.deterministic is None else {"deterministic": st.deterministic}
                for _ in range(st.repeat):
                    rec.site = join(st.name)
                    if isinstance(target, (nnx.RNN, nnx.Bidirectional)):
                        _rnn_call(st, target, rec)
                    elif st.transform is not None:
                        run_target = functools.partial(_run_target, deterministic=st.deterministic)
                        transformed(st.transform, run_target, target, x, rec, join(st.name))
                    elif st.given_rngs:
                        # drop(x, rngs=rngs), the Rngs the model's call was given: it draws rngs[rng_collection]()
                        rngs = rec.call_rngs if st.given_rngs == "call" else rec.model_rngs
                        if isinstance(target, nnx.MultiHeadAttention):
                            target(jnp.ones((1, 2, 2)), rngs=rngs, **given_mode)  # (it draws rngs.dropout())
                        else:
                            target(jnp.ones((64,)), rngs=rngs, **given_mode)
                    elif st.key is not None:
                        # drop(x, rngs=key): what NNX does with the key is seen in the mask it drops
                        y = target(jnp.ones((64,)), rngs=eval_key(st.key.expr, raw=False), **given_mode)

                        def given(y, step=rec.step, site=rec.site, rate=target.rate):
                            mask = tuple(bool(v) for v in np.asarray(y != 0))
                            rec.records.append({"step": step, "site": site, "given": True, "mask": mask, "rate": rate})

                        quiet = target.deterministic if st.deterministic is None else st.deterministic
                        if quiet or not 0.0 < target.rate < 1.0:
                            pass  # (NNX uses no key: it drops nothing, or everything)
                        elif isinstance(y, jax.core.Tracer):  # (inside a branch, a loop or a jitted step)
                            jax.debug.callback(given, y, ordered=True)
                        else:
                            given(y)
                    elif id(getattr(target, "to_nnx__module", None)) in rec.bridges:
                        builder = rec.linen_builder()
                        builder.phase = "init" if target._pytree__state.initializing else "apply"
                        rec.site = join(st.name) + ".to_nnx__rngs"
                        target(builder.input_for(rec.bridges[id(target.to_nnx__module)]))
                    else:
                        _run_target(target, x, st.deterministic)
            elif isinstance(st, NnxDraw):
                # `from: enc`: self.enc.rngs.<stream>() (what a method of enc drawing from its own Rngs does);
                # `from: rng`: the stream kept by `fork:`, self.rng() (drawn at that attribute)
                keeper = _attribute(self, st.keeper) if st.keeper else self
                kept = isinstance(keeper, nnx.RngStream)
                for _ in range(st.repeat):
                    rec.site = join(st.keeper) if st.keeper else path or "(root)"
                    rec.draw = st.draw
                    try:
                        (keeper if kept else getattr(keeper.rngs, st.stream))()
                    finally:
                        rec.draw = None

    return type(mod.cls, (nnx.Module,), {"__init__": __init__, "__call__": __call__, "oracle_run": run})


def _has_when(statements) -> bool:
    """Whether a module's call statements (branch and loop bodies included) draw in one mode only (`when:`)."""
    for st in statements:
        if isinstance(st, (NnxDraw, NnxCall)) and st.when is not None:
            return True
        if isinstance(st, NnxCond) and any(_has_when(b) for b in st.branches):
            return True
        if isinstance(st, NnxLoop) and _has_when(st.body):
            return True
    return False


def _stacked(cls, n: int):
    """The scan-over-layers / ensemble idiom: split_rngs around vmap at construction."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return cls(rngs)

    return create


def _stacked_from(cls, st: NnxChild, rngs):
    """An ensemble built by nnx.vmap over rngs.split(N) / rngs.broadcast(N) (with `only`: the mapping form, the
    other streams passed through, and StateAxes that map only the split ones)."""
    make = getattr(rngs, st.rngs)
    if not st.only:
        return nnx.vmap(lambda r: cls(r), in_axes=0)(make(st.stack))
    axes = nnx.StateAxes({_tags(st.only): 0, ...: None})
    return nnx.vmap(lambda r: cls(r), in_axes=(axes,))(make({_tags(st.only): st.stack, ...: None}))


def _run_target(target, x, deterministic: bool | None = None):
    given = {} if deterministic is None else {"deterministic": deterministic}
    if isinstance(target, nnx.Dropout):
        target(jnp.ones((4,)), **given)
    elif isinstance(target, nnx.MultiHeadAttention):
        target(jnp.ones((1, 2, 2)), **given)
    elif isinstance(target, nnx.Module) and not type(target).__module__.startswith("flax"):
        target(x)


def barrier(x) -> None:
    """Waits for the keys recorded by callbacks (outside a trace: inside one they run with it)."""
    if not isinstance(x, jax.core.Tracer):
        jax.effects_barrier()


def _tags(streams: tuple[str, ...]):
    return streams[0] if len(streams) == 1 else streams


def transformed(t: NnxTransform, run, target, x, rec: _Recorder, site: str) -> None:
    """`run(target, x)` under the nnx.vmap / nnx.scan the transform describes, written as users write it."""
    if t.kind == "scan" and not t.lanes:

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def over_layers(h, layer):
            run(layer, h)
            return h

        over_layers(x, target)
    elif t.kind == "vmap" and not t.lanes:

        @nnx.vmap(in_axes=(0, None), out_axes=0)
        def over_members(member, h):
            run(member, h)
            return h

        over_members(target, x)
    elif t.kind == "scan":
        axes = nnx.StateAxes({_tags(t.streams): None, ...: nnx.Carry} if t.streams else {...: nnx.Carry})

        @nnx.scan(in_axes=(axes, nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def unroll(m, h, xs):
            run(m, h)
            return h, xs

        unroll(target, x, jnp.zeros((t.lanes,)))
    else:
        xs = jnp.ones((t.lanes,) + x.shape)
        if t.streams:
            axes = nnx.StateAxes({_tags(t.streams): 0, ...: None})

            @nnx.split_rngs(splits=t.lanes, only=_tags(t.streams))
            @nnx.vmap(in_axes=(axes, 0), out_axes=0)
            def lanes(m, h):
                run(m, h)
                return h

            rec.site = site
            lanes(target, xs)
        else:

            @nnx.vmap(in_axes=(None, 0), out_axes=0)
            def broadcast(m, h):
                run(m, h)
                return h

            broadcast(target, xs)
    jax.effects_barrier()


def _rngs(sources: dict) -> nnx.Rngs:
    """`nnx.Rngs(default, **streams)` of a spec's streams and seeds."""
    streams = {name: eval_key(src.expr, raw=False) for name, src in sources.items()}
    return nnx.Rngs(streams.pop("default", None), **streams)


def nnx_keys(spec: NnxSpec) -> list[dict]:
    """Every key real NNX hands out for the spec's model: construction (step 0), then steps 1..N."""
    rec = _Recorder()
    with nnx_settings(spec), rec.installed():
        rngs = rec.model_rngs = _rngs(spec.rngs)
        model = _class(spec.model, rec, "", {})(rngs)
        if spec.call_rngs:
            # rngs = nnx.Rngs(dropout=1), given to every call (model(x, rngs=rngs) hands it to its Dropouts)
            rec.call_rngs = _rngs(spec.call_rngs)
        x = jnp.ones((1,))
        labels = run_draw_steps(spec.run)
        for at, event in enumerate(spec.run):
            if isinstance(event, NnxRunDraw):
                # model.rngs.<stream>() in the training step, outside the model's call: the next call's step
                keeper = _attribute(model, event.keeper) if event.keeper else model  # (`from:` model.enc.rngs)
                kept = isinstance(keeper, nnx.RngStream)  # (`from:` a stream kept by `fork:`, model.enc.rng)
                now, rec.step, rec.site = rec.step, labels[at], event.keeper or "(root)"
                for _ in range(event.repeat):
                    (keeper if kept else getattr(keeper.rngs, event.stream))()
                rec.step = now
                continue
            if getattr(event, "lazy_init", False):
                from flax.nnx import bridge

                bridge.lazy_init(model, x)  # (its keys are init's: step 0)
                continue
            if isinstance(event, NnxMode):
                if event.deterministic:
                    model.eval()
                else:
                    model.train()
                continue
            if isinstance(event, NnxReseed):
                # (reseed's own Rngs hands out the new stream keys: not keys the model draws)
                rec.off = True
                node = _attribute(model, event.module) if event.module else model  # (nnx.reseed(model.enc, ...))
                policy = {"policy": event.policy} if event.policy != "scalars_only" else {}
                nnx.reseed(node, **policy, **{s: eval_key(src.expr, raw=False) for s, src in event.streams})
                rec.off = False
                continue
            for _ in range(event.n):
                rec.step += 1
                if spec.call_rngs_steps is not None:
                    # model(x, rngs=nnx.Rngs(dropout=jax.random.fold_in(key, step))): an Rngs made for this step
                    given = spec.call_rngs_steps[rec.step - 1]
                    rec.call_rngs = None if given is None else _rngs(given)  # (null: model(x), given none)
                if getattr(event, "fork", None) is not None:
                    # with nnx.fork_rngs(model, split={tags: None}): model(x) (under its transform, if any)
                    rec.site = "(root)"
                    with nnx.fork_rngs(model, split={_tags(event.fork) if event.fork else ...: None}):
                        if event.transform is not None:
                            transformed(event.transform, lambda m, h: m(h), model, x, rec, "(root)")
                        else:
                            model(x)
                elif event.stale:
                    # the pure jitted step: split, merge inside jax.jit, run, and drop the state it returns
                    graphdef, state = nnx.split(model)

                    def pure(state, x, graphdef=graphdef):
                        m = nnx.merge(graphdef, state)
                        m(x)
                        return nnx.state(m)

                    jax.jit(pure)(state, x)
                    jax.effects_barrier()
                elif event.transform is not None:
                    rec.site = "(root)"
                    transformed(event.transform, lambda m, h: m(h), model, x, rec, "(root)")
                else:
                    model(x)
        jax.effects_barrier()
        return rec.records + [dict(r, linen=True) for r in rec.linen_records()]


def derive_records(report) -> list[dict]:
    """derive's keys as the oracle records them. A stream nnx.vmap broadcasts hands every lane the same key,
    which JAX computes once (unbatched), so NNX's wrapped RngStream.__call__ sees it once: lane 0 only."""
    out = []
    for c in report.calls:
        d = c.derivation
        if d.linen:
            out.append({"linen": True, "stream": d.tag, "count": d.count, "key": tuple(c.key)})
            continue
        if d.given:
            if not ("vmap" in d.broadcast and d.lane > 0):  # (one mask for every lane: NNX computes it once)
                out.append({"given": True, "step": d.step, "key": tuple(c.key)})
            continue
        if "vmap" in d.broadcast and d.lane > 0:
            continue
        out.append({"step": d.step, "site": d.site, "tag": d.tag, "count": d.count, "key": tuple(c.key), "call": c})
    return out


def _same_site(ours: str, theirs: str, kind: str = "") -> bool:
    """derive's site is the oracle's or under it; a split or fork of the model's streams by a transform or
    fork_rngs (the oracle's site: the model, `(root)`) is at the layer or module keeping the stream."""
    return ours == theirs or ours.startswith(theirs + ".") or (theirs == "(root)" and kind in ("split", "fork"))


def both_sides(spec, flax_keys_of, raised: tuple):
    """derive's report (or FlaxError) and the keys real Flax hands out (`flax_keys_of(spec)`, or the error of a class
    in `raised` it raises): (report, our error, their keys, their error)."""
    from rngaudit import FlaxError, derive

    report = ours_error = theirs = theirs_error = None
    try:
        report = derive(spec)
    except FlaxError as e:
        ours_error = e
    try:
        theirs = flax_keys_of(spec)
    except raised as e:
        theirs_error = e
    return report, ours_error, theirs, theirs_error


def same_error(ours_error, theirs_error) -> str:
    """Asserts that rngaudit raised the error real Flax did (its class, and the head of its text: an NNX error's text
    runs on with internal values); returns its class name."""
    assert theirs_error is not None, f"rngaudit predicts an error Flax does not raise: {ours_error}"
    assert ours_error is not None, f"Flax raises {type(theirs_error).__name__}: {theirs_error}; rngaudit derived keys"
    name = type(theirs_error).__name__
    assert ours_error.flax_error == name, f"rngaudit: {ours_error}; flax: {name}: {theirs_error}"
    core = str(theirs_error).strip("'\"").split(" (")[0]
    assert core[:40] in ours_error.message, f"rngaudit: {ours_error.message!r}; flax: {core!r}"
    return name


def check_against_nnx(spec: NnxSpec) -> dict:
    """Asserts that rngaudit's derive and real NNX agree on every key (step, site, tag, count, key data) in
    order, or raise the same error class. Returns {'keys': n} or {'error': name}."""
    report, ours_error, theirs, theirs_error = both_sides(spec, nnx_keys, (AttributeError, KeyError, ValueError))
    if ours_error is not None or theirs_error is not None:
        return {"error": same_error(ours_error, theirs_error)}
    ours = derive_records(report)
    ours_linen = [(r["stream"], r["count"], r["key"]) for r in ours if r.get("linen")]
    theirs_linen = [(r["stream"], r["count"], tuple(r["key"])) for r in theirs if r.get("linen")]
    if any(getattr(e, "stale", False) for e in report.spec.run):
        # the Linen oracle records a key traced inside jax.jit once per trace event, and a stale step's key is
        # the same as the step before's: compare the keys each side has, in the order first handed out
        ours_linen, theirs_linen = list(dict.fromkeys(ours_linen)), list(dict.fromkeys(theirs_linen))
    assert ours_linen == theirs_linen, f"Linen keys inside bridge.ToNNX: rngaudit {ours_linen} != flax {theirs_linen}"
    ours = [r for r in ours if not r.get("linen")]
    theirs = [r for r in theirs if not r.get("linen")]
    # keys given to a Dropout's call: the mask NNX dropped must be the one the derived key draws
    ours_given = [r for r in ours if r.get("given")]
    theirs_given = [r for r in theirs if r.get("given")]
    assert len(ours_given) == len(theirs_given), f"given keys: rngaudit {len(ours_given)}, nnx {len(theirs_given)}"
    with nnx_settings(report.spec):
        for a, b in zip(ours_given, theirs_given):
            key = jax.random.wrap_key_data(jnp.asarray(a["key"], jnp.uint32))
            keep = np.asarray(jax.random.bernoulli(key, 1.0 - b["rate"], (64,)))
            assert tuple(bool(v) for v in keep) == b["mask"] and a["step"] == b["step"], (a, b)
    ours = [r for r in ours if not r.get("given")]
    theirs = [r for r in theirs if not r.get("given")]
    # one ToNNX call draws one key from every stream of its Rngs in the Rngs' attribute order, which NNX sorts
    # once the module went through a graph transform (nnx.cond, a loop, jit): the order within one call is
    # not a key's, so each call's draws compare in one order
    ours, theirs = _bridge_calls_sorted(ours), _bridge_calls_sorted(theirs)
    assert len(ours) == len(theirs), f"rngaudit has {len(ours)} keys, nnx {len(theirs)}: {ours[:3]} / {theirs[:3]}"
    stale_bridge = any(getattr(e, "stale", False) for e in report.spec.run) and bool(ours_linen)
    if _has_lanes(report.spec) or stale_bridge:
        # under nnx.vmap NNX hands out a draw's keys for every lane at once (rngaudit lists lane by lane); in a
        # jitted step the debug callbacks of a ToNNX's draws and its Linen keys' callbacks interleave
        order = lambda r: (r["step"], r["tag"], r["count"], r["key"])
        ours, theirs = sorted(ours, key=order), sorted(theirs, key=order)
    seen = set()
    for i, (a, b) in enumerate(zip(ours, theirs)):
        same = (a["step"], a["tag"], a["count"], a["key"]) == (b["step"], b["tag"], b["count"], b["key"])
        assert same and _same_site(a["site"], b["site"], a["call"].derivation.kind), f"key {i}: rngaudit {a} != nnx {b}"
        c = a["call"]
        if "value" in b:
            # the values the model drew (under nnx.vmap as jax.vmap draws them)
            assert c.values is not None, f"key {i}: nnx drew {b['value']}, rngaudit no values"
            assert c.values.dtype == b["value"].dtype and np.array_equal(c.values, b["value"]), (
                f"key {i}: values differ: rngaudit {c.values}, nnx {b['value']}"
            )
            seen.add(c.index)
    return {
        "keys": len(ours),
        **({"linen": len(ours_linen)} if ours_linen else {}),
        **({"given": len(ours_given)} if ours_given else {}),
        "values": _check_values(report, seen),
    }


def _bridge_calls_sorted(rows: list[dict]) -> list[dict]:
    """Runs of draws of one ToNNX call (site `X.to_nnx__rngs`, one step) sorted by stream."""
    out: list[dict] = []
    run: list[dict] = []
    for r in rows + [{}]:
        if run and not (r.get("site") == run[0]["site"] and r.get("step") == run[0]["step"]):
            out += sorted(run, key=lambda q: q["tag"])
            run = []
        if str(r.get("site", "")).endswith(".to_nnx__rngs"):
            run.append(r)
        elif r:
            out.append(r)
    return out


def _has_lanes(spec: NnxSpec) -> bool:
    def module(m: NnxModule) -> bool:
        for st in m.init:
            if isinstance(st, NnxChild) and (st.stack or module(st.module)):
                return True
        return any(isinstance(st, NnxCall) and st.transform is not None for st, _ in nested(m.call))

    return module(spec.model) or any(getattr(e, "transform", None) is not None for e in spec.run)


def _check_values(report, seen: set) -> int:
    """derive's drawn values: those the model drew (`seen`, compared already), the others against jax.random on
    the key NNX handed out (the key already matched), but for rbg keys in an nnx.vmap lane, which jax.vmap draws
    all at once (the model's layers' parameters there: checked as `draw:` statements in lanes are)."""
    n = len(seen)
    with nnx_settings(report.spec):
        for c in report.calls:
            if c.values is None or c.draw is None or c.index in seen:
                continue
            if c.derivation.batched and report.spec.prng_impl in ("rbg", "unsafe_rbg"):
                continue
            key = jax.random.wrap_key_data(jnp.asarray(c.key, jnp.uint32))
            assert np.array_equal(np.asarray(draw_fn(c.draw)(key)), c.values), f"values of key {c.index} differ"
            n += 1
    return n


# ---------------------------------------------------------------- what the NNX spec tests share
NNX_HEAD = "rngaudit: 1\nflavour: nnx\n"


def nnx_spec(text: str):
    """An NNX spec from the lines after its head (dedented)."""
    import textwrap

    from rngaudit import parse_spec

    return parse_spec(NNX_HEAD + textwrap.dedent(text))


def agree(text: str) -> dict:
    """check_against_nnx of the spec: every key derive gives is the one real NNX hands out."""
    return check_against_nnx(nnx_spec(text))


def write_nnx_spec(text: str, directory=None) -> str:
    """The spec written to a file (in a fresh temporary folder unless given); its path."""
    import tempfile
    import textwrap
    from pathlib import Path

    from support import write

    return write(Path(directory or tempfile.mkdtemp()), "spec.yaml", NNX_HEAD + textwrap.dedent(text))


def assert_one_error_line(tmp_path, text: str, message: str) -> None:
    """A bad NNX spec: derive raises SpecError saying `message`, and the command prints one `error: FILE:...`
    line with it and exits 2."""
    import pytest
    from support import invoke

    from rngaudit import SpecError, derive

    path = write_nnx_spec(text, tmp_path)
    with pytest.raises(SpecError) as e:
        derive(path)
    assert message in str(e.value), str(e.value)
    r = invoke("derive", path)
    assert r.exit_code == 2 and r.stderr.startswith(f"error: {path}:") and len(r.stderr.splitlines()) == 1
    assert message in r.stderr


# ---------------------------------------------------------------- NNX inside Linen: bridge.ToLinen
_TO_LINEN: list = []  # the recorder the NNX modules of ToLinen modules record into (to_linen_keys sets it)


def to_linen_module(mod, kw: dict):
    """`bridge.ToLinen(NnxClass, skip_rng=..., name=...)` of a Linen spec's ToLinen statement (the Linen oracle's
    builder calls this); its NNX class is built as the NNX oracle builds a model's."""
    from flax.nnx import bridge

    rec = _TO_LINEN[-1] if _TO_LINEN else _Recorder()
    tl = mod.to_linen
    cls = _class(tl.module, rec, "", {})
    if tl.skip_rng:
        base = cls

        class cls(base):  # (an __init__ that takes no rngs: what skip_rng=True calls)
            def __init__(self):
                super().__init__(nnx.Rngs())

    return bridge.ToLinen(cls, skip_rng=tl.skip_rng, **kw)


def to_linen_keys(spec) -> list[dict]:
    """Every key the NNX streams inside the Linen spec's ToLinen modules hand out in its init (or apply, after an
    init that made the variables), in order: (tag, count, key)."""
    from flax_oracle import X, _Builder, _Capture, flax_settings, init_streams

    rec = _Recorder()
    _TO_LINEN.append(rec)
    try:
        with flax_settings(spec), rec.installed():
            builder = _Builder(_Capture())
            model = builder.construct(spec.model, spec.model.name)
            rngs = {s: eval_key(src.expr, raw=False) for s, src in spec.rngs.items()}
            if spec.phase == "init":
                model.init(rngs, X)
            else:
                variables = model.init({"params": jax.random.key(0), **init_streams(spec), **rngs}, X)
                rec.records.clear()
                mutable = list(spec.mutable) if isinstance(spec.mutable, tuple) else spec.mutable
                model.apply(variables, X, rngs=rngs, mutable=mutable)
            jax.effects_barrier()
    finally:
        _TO_LINEN.pop()
    # (a key given to a Dropout's call is recorded as the mask it drew: check_to_linen counts those)
    return [
        {"tag": r["tag"], "count": r["count"], "key": tuple(r["key"])} if "tag" in r else {"given": True}
        for r in rec.records
    ]


def check_to_linen(spec) -> dict:
    """Asserts that rngaudit and real Flax agree on a Linen spec with ToLinen modules: the Linen keys (ToLinen's
    make_rng calls among them, the Linen oracle's check) and every key the NNX modules' streams hand out, in
    order, or the same error. Returns what was compared."""
    from flax_oracle import check_against_flax

    report, ours_error, theirs, theirs_error = both_sides(spec, to_linen_keys, (Exception,))
    if ours_error is not None or theirs_error is not None:
        return {"error": same_error(ours_error, theirs_error)}
    linen = check_against_flax(spec)
    # (derive_records: a stream nnx.vmap broadcasts hands every lane one key, which NNX computes once)
    ours = [
        {"tag": r["tag"], "count": r["count"], "key": r["key"]} if not r.get("given") else {"given": True}
        for run in report.to_linen
        for r in derive_records(run.report)
    ]
    if any(_has_lanes(run.report.spec) for run in report.to_linen):
        # under nnx.vmap NNX hands out a draw's keys for every lane at once (rngaudit lists lane by lane)
        order = lambda r: (r.get("tag", ""), r.get("count", -1), r.get("key", ()))
        ours, theirs = sorted(ours, key=order), sorted(theirs, key=order)
    if any(run.lane for run in report.to_linen):
        # in Linen's lanes (nn.vmap, nn.scan around the ToLinen) JAX computes a key all lanes share (a stream the
        # transform does not split) once: the distinct keys compare, each lane's are derive's
        order = lambda r: (r.get("tag", ""), r.get("count", -1), r.get("key", ()))
        ours = sorted({tuple(sorted(r.items())): r for r in ours}.values(), key=order)
        theirs = sorted({tuple(sorted(r.items())): r for r in theirs}.values(), key=order)
    assert ours == theirs, f"NNX keys inside ToLinen: rngaudit {ours} != flax {theirs}"
    return {"linen": linen.keys, "nnx": len(ours), "runs": len(report.to_linen)}
