"""A spec's checks on the devices: root keys, base keys, keys and draws re-derived under jax.jit with the
rows sharded over the mesh, each compared with the host derivation."""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from typing import Any

import numpy as np

from ..engine.draws import draw
from ..engine.keys import BaseKeys, JaxKeys, KeyData, evaluate
from ..errors import Location, UsageError
from ..spec.keyexpr import KeyExpr, largest_split
from ..spec.tree import Draw
from .arrays import compare
from .devices import distinct_blocks, partition_for, partition_text, rows_sharding
from .report import FAIL, NOT_APPLICABLE, PASS, Check, TargetResult
from .request import DEVICE_SPLIT_MAX, SpecTarget

MAX_LISTED = 20  # mismatching rows listed per check


# ---------------------------------------------------------------- jitted key operations
def _per_row(one, impl: str):
    """`one` over the rows of its arguments."""
    import jax

    if impl == "unsafe_rbg":
        # lax.map, not vmap: jax/_src/lax/control_flow/loops.py _rng_bit_generator_batching_rule seeds a
        # vmapped rng_bit_generator from keys[0] only (see rngaudit/engine/keys.py KeyEngine.fold_in_many)
        return lambda *cols: jax.lax.map(lambda row: one(*row), cols)
    return jax.vmap(one)


# Jitted functions are built once per process and reused by every spec: jax.jit caches compilations per
# function object (and per threefry_partitionable setting), so building one per spec would compile again.


@functools.cache
def _rows_jit(op: str, impl: str, mesh, n_split: int = 0):
    """jax.jit of a per-row key operation with the rows split over every mesh axis: `fold` is
    fold_in(base, word), `split` is split(base, n_split)[index]."""
    import jax

    def fold(base, word):
        return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(base, impl=impl), word))

    def split(base, index):
        return jax.random.key_data(jax.random.split(jax.random.wrap_key_data(base, impl=impl), n_split)[index])

    sharding = rows_sharding(mesh)
    return jax.jit(
        _per_row(fold if op == "fold" else split, impl), in_shardings=(sharding, sharding), out_shardings=sharding
    )


def _bucket(m: int, n: int) -> int:
    """Rows padded to n devices times a power of two, so specs of similar size share one compilation."""
    per = max(1, -(-m // n))
    return n * (1 << (per - 1).bit_length())


def _sharded_rows(op: str, impl: str, mesh, bases: np.ndarray, args: np.ndarray, n_split: int = 0) -> np.ndarray:
    """The key operation on every row in one jitted call, the rows split over the devices."""
    m = len(bases)
    pad = _bucket(m, mesh.size) - m
    if pad:
        bases = np.concatenate([bases, np.repeat(bases[:1], pad, axis=0)])
        args = np.concatenate([args, np.repeat(args[:1], pad, axis=0)])
    return np.asarray(_rows_jit(op, impl, mesh, n_split)(bases, args))[:m]


@functools.cache
def _root_jit(expr: KeyExpr, impl: str, mesh):
    """jax.jit computing a root key from its expression, replicated on every device."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.jit(
        lambda: jax.random.key_data(evaluate(expr, JaxKeys(impl))), out_shardings=NamedSharding(mesh, PartitionSpec())
    )


@functools.cache
def _draw_jit(kind: str, shape: tuple, dtype: str, params: tuple, impl: str, mesh):
    """jax.jit of one draw from key data, its output partitioned over the mesh as far as the shape allows."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    spec_draw = Draw(kind, shape, dtype, params, Location("-", 1, 1))
    part = partition_for(shape, list(zip(mesh.axis_names, mesh.devices.shape)))
    fn = jax.jit(
        lambda kd: draw(jax.random.wrap_key_data(kd, impl=impl), spec_draw),
        out_shardings=NamedSharding(mesh, PartitionSpec(*part)),
    )
    return fn, part


# ------------------------------------------------------------------ spec checks
def _selected(d, t: SpecTarget) -> bool:
    if t.paths and not any(fnmatch.fnmatchcase(d.path_str, g) for g in t.paths):
        return False
    return not t.streams or d.stream in t.streams or d.stream_requested in t.streams


def _row_json(d, host=None, device=None) -> dict:
    out = {
        "index": d.index,
        "path_str": d.path_str,
        "stream": d.stream,
        "count": d.count,
        "label": d.label,
        "lane": list(d.lane),
        "location": d.location.as_json(),
    }
    if host is not None:
        out["host"] = [int(w) for w in host]
        out["device"] = [int(w) for w in device]
    return out


def check_spec(t: SpecTarget, mesh) -> TargetResult:
    import jax

    from ..engine.derive import derive
    from ..engine.keys import engine_for
    from ..engine.refs import ForkKey, RootKey
    from ..spec.parse import linen_only, load_spec

    spec = linen_only(load_spec(t.file), "shard-check --spec")
    if t.phase is not None and t.phase != spec.phase:
        spec = dataclasses.replace(spec, phase=t.phase, mutable=t.phase == "init")
    devices = list(mesh.devices.flat)
    n = len(devices)
    with jax.default_device(devices[0]):
        report = derive(spec, values=True, default_draw=t.draw)
    keyed = [c for c in report.calls if c.key is not None]
    chosen = [c for c in keyed if _selected(c.derivation, t)]
    if (t.paths or t.streams) and not chosen:
        sel = " ".join([f"--path {g!r}" for g in t.paths] + [f"--stream {s!r}" for s in t.streams])
        raise UsageError(f"{spec.file}: {sel} select none of its {len(keyed)} keys")
    engine = engine_for(spec)
    impl, width = spec.prng_impl, engine.width

    def fork_key(i: int) -> KeyData:
        key = report.calls[i].key
        assert key is not None  # (a jit fork's key exists)
        return key

    host_key = BaseKeys(engine, report.roots, fork_key).key

    # every base a chosen key hangs from, down to the roots: each is one split or fold of its parent
    bases: dict = {}
    todo: list[Any] = [c.derivation.base for c in chosen]
    while todo:
        ref = todo.pop()
        if isinstance(ref, RootKey) or ref in bases:
            continue
        bases[ref] = None
        todo.append(report.calls[ref.index].derivation.base if isinstance(ref, ForkKey) else ref.parent)

    with jax.threefry_partitionable(spec.threefry_partitionable):
        checks = [
            _root_check(spec, report.roots, mesh),
            _base_check(list(bases), host_key, report, impl, width, mesh),
            _key_check(chosen, host_key, impl, width, mesh),
            _draw_check(chosen, impl, mesh),
        ]
    info = {
        "file": spec.file,
        "phase": spec.phase,
        "prng_impl": impl,
        "threefry_partitionable": spec.threefry_partitionable,
        "fix_rng_separator": spec.fix_rng_separator,
        "rules": spec.rules.name,
        "paths": list(t.paths),
        "streams": list(t.streams),
        "draw": t.draw.describe() if t.draw else None,
        "keys": len(report.calls),
        "checked_keys": len(chosen),
        "not_checked_discarded": len(report.calls) - len(keyed),
        "devices": n,
    }
    return TargetResult("spec", spec.file, info, tuple(checks))


def _root_check(spec, roots: dict, mesh) -> Check:
    title = "root keys"
    if not spec.rngs:
        return Check("root_keys", title, NOT_APPLICABLE, "the spec passes no rngs")
    streams, wrong, skipped = [], [], []
    for stream in sorted(spec.rngs):
        src = spec.rngs[stream]
        entry = {"stream": stream, "expr": src.text, "host": list(roots[stream])}
        if largest_split(src.expr) > DEVICE_SPLIT_MAX:
            skipped.append(stream)
            entry["device"] = None
            streams.append(entry)
            continue
        out = _root_jit(src.expr, spec.prng_impl, mesh)()
        copies = {tuple(int(w) for w in np.asarray(s.data)) for s in out.addressable_shards}
        entry["device"] = [list(c) for c in sorted(copies)]
        if copies != {tuple(roots[stream])}:
            wrong.append(stream)
        streams.append(entry)
    details = {"streams": streams, "mismatched": wrong, "not_checked": skipped}
    checked = len(streams) - len(skipped)
    if wrong:
        return Check(
            "root_keys",
            title,
            FAIL,
            f"{len(wrong)} of {checked} root keys derived on the devices differ from the host's: {', '.join(wrong)}",
            details,
        )
    if not checked:
        return Check(
            "root_keys",
            title,
            NOT_APPLICABLE,
            f"every root splits more than {DEVICE_SPLIT_MAX} keys; not derived on the devices",
            details,
        )
    extra = (
        f" ({len(skipped)} splitting more than {DEVICE_SPLIT_MAX} keys not derived on the devices)" if skipped else ""
    )
    return Check(
        "root_keys",
        title,
        PASS,
        f"{checked} root key(s) derived from their expressions under jax.jit on "
        f"all {mesh.size} devices equal the host's on every device{extra}",
        details,
    )


def _base_check(refs: list, host_key, report, impl: str, width: int, mesh) -> Check:
    from ..engine.refs import ForkKey, SplitKey

    title = "base keys"
    if not refs:
        return Check(
            "base_keys",
            title,
            NOT_APPLICABLE,
            "every checked key folds a root key directly (no vmap/scan split, while_loop fold or jit fork)",
        )
    folds = [r for r in refs if not isinstance(r, SplitKey)]
    splits = [r for r in refs if isinstance(r, SplitKey) and r.n <= DEVICE_SPLIT_MAX]
    skipped = len(refs) - len(folds) - len(splits)
    got: dict = {}
    if folds:
        parents, words = [], []
        for r in folds:
            if isinstance(r, ForkKey):
                d = report.calls[r.index].derivation
                parents.append(host_key(d.base))
                words.append(d.hash_word)
            else:
                parents.append(host_key(r.parent))
                words.append(r.data)
        # fold_in takes its data as uint32, wrapping negatives (a while_loop cond folds in -i)
        out = _sharded_rows(
            "fold",
            impl,
            mesh,
            np.asarray(parents, np.uint32).reshape(-1, width),
            np.asarray(words, np.int64).astype(np.uint32),
        )
        got.update(zip(folds, map(tuple, out.tolist())))
    by_n: dict = {}
    for r in splits:
        by_n.setdefault(r.n, []).append(r)
    for n_split, group in by_n.items():
        out = _sharded_rows(
            "split",
            impl,
            mesh,
            np.asarray([host_key(r.parent) for r in group], np.uint32).reshape(-1, width),
            np.asarray([r.index for r in group], np.int32),
            n_split,
        )
        got.update(zip(group, map(tuple, out.tolist())))
    wrong = [r for r, k in got.items() if k != tuple(host_key(r))]
    details = {
        "checked": len(got),
        "splits": len(splits),
        "folds": len(folds),
        "not_checked": skipped,
        "mismatches": [{"base": str(r), "host": list(host_key(r)), "device": list(got[r])} for r in wrong[:MAX_LISTED]],
        "mismatched": len(wrong),
    }
    if wrong:
        return Check(
            "base_keys",
            title,
            FAIL,
            f"{len(wrong)} of {len(got)} base keys (lane splits, loop folds, jit "
            "forks) re-derived on the devices differ from the host's",
            details,
        )
    if not got:
        return Check(
            "base_keys",
            title,
            NOT_APPLICABLE,
            f"every base splits more than {DEVICE_SPLIT_MAX} keys; not re-derived on the devices",
            details,
        )
    return Check(
        "base_keys",
        title,
        PASS,
        f"{len(got)} base key(s) ({len(splits)} splits, {len(folds)} folds and "
        f"forks) re-derived from their parents under jax.jit, sharded over {mesh.size} devices, equal the "
        "host's",
        details,
    )


def _key_check(chosen: list, host_key, impl: str, width: int, mesh) -> Check:
    title = "keys"
    if not chosen:
        return Check("keys", title, NOT_APPLICABLE, "the spec makes no key")
    bases = np.asarray([host_key(c.derivation.base) for c in chosen], np.uint32).reshape(-1, width)
    words = np.asarray([c.derivation.hash_word for c in chosen], np.uint32)
    out = _sharded_rows("fold", impl, mesh, bases, words)
    expected = np.asarray([c.key for c in chosen], np.uint32).reshape(-1, width)
    bad = np.flatnonzero((out != expected).any(axis=1))
    details = {
        "checked": len(chosen),
        "mismatched": len(bad),
        "mismatches": [_row_json(chosen[i].derivation, expected[i], out[i]) for i in bad[:MAX_LISTED]],
    }
    if len(bad):
        return Check(
            "keys",
            title,
            FAIL,
            f"{len(bad)} of {len(chosen)} keys re-derived on the devices differ from the host derivation",
            details,
        )
    return Check(
        "keys",
        title,
        PASS,
        f"{len(chosen)} key(s) re-derived on the devices (fold_in of the base key with "
        f"the hash word under jax.jit, rows sharded over {mesh.size} devices) equal the host derivation "
        "bit for bit",
        details,
    )


def _draw_check(chosen: list, impl: str, mesh) -> Check:
    title = "draws"
    rows = [c for c in chosen if c.values is not None]
    if not rows:
        return Check("draws", title, NOT_APPLICABLE, "no checked key has a `draw:` (try --draw KIND:SHAPE)")
    wrong, split_over, shapes = [], 0, set()
    for c in rows:
        d = c.draw
        fn, part = _draw_jit(d.kind, d.shape, d.dtype, d.params, impl, mesh)
        out = fn(np.asarray(c.key, np.uint32))
        if distinct_blocks(out) > 1:
            split_over += 1
        shapes.add(partition_text(part))
        diff = compare(c.values, np.asarray(out))
        if diff["mismatched"]:
            wrong.append(
                dict(
                    _row_json(c.derivation),
                    **diff,
                    draw=c.draw.describe(),
                    partition=partition_text(part),
                    elements=int(c.values.size),
                )
            )
    details = {
        "checked": len(rows),
        "split_over_devices": split_over,
        "replicated": len(rows) - split_over,
        "partitions": sorted(shapes),
        "mismatched": len(wrong),
        "mismatches": wrong[:MAX_LISTED],
    }
    if wrong:
        return Check(
            "draws",
            title,
            FAIL,
            f"{len(wrong)} of {len(rows)} draws under jax.jit with sharded output "
            "differ from the eager draw on one device",
            details,
        )
    rep = (
        f"; {len(rows) - split_over} too small to split over the mesh ran replicated" if split_over < len(rows) else ""
    )
    return Check(
        "draws",
        title,
        PASS,
        f"{len(rows)} draw(s) under jax.jit with the output sharded over "
        f"{mesh.size} devices equal the eager draw on one device bit for bit{rep}",
        details,
    )
