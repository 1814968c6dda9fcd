"""A user's (key, x) function on the devices: run eagerly, under jax.jit with the batch sharded, and under
shard_map with split keys and with one replicated key; the same randomness on several devices is found."""

from __future__ import annotations

import inspect

import numpy as np

from ..engine.keys import JaxKeys, evaluate, jax_setting
from ..errors import Location, UsageError, UserCodeError
from ..spec.keyexpr import parse as parse_key_expr
from ..spec.keyexpr import raw_words
from ..usercode import CodeRef, first_line, load_callable
from .arrays import beyond_rounding, compare
from .devices import (
    distinct_blocks,
    partition_text,
    rows_sharding,
    shard_map,
)
from .report import ALLOWED, FAIL, FINDING, INFO, NOT_APPLICABLE, PASS, Check, TargetResult
from .request import ShardRequest, mesh_text

PREVIEW = 16  # values shown per device slice or output


class _NeedsMeshAxes(Exception):
    """The function names mesh axes (jax.lax.axis_index, psum): it runs only inside shard_map."""


def load_function(t: CodeRef):
    """Import the module or file and return the function, checked to accept (key, x)."""
    obj = load_callable(t, "--fn")
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return obj
    try:
        sig.bind(None, None)
    except TypeError:
        raise UserCodeError(
            f"--fn {t.text}: {t.attr}{sig} cannot be called as {t.attr}(key, x); shard-check "
            "passes a PRNG key and a batch x"
        ) from None
    return obj


def _call(t: CodeRef, where: str, fn, *args, mesh=None):
    """Run the user's code and wait for its result; its failures become one-line UserCodeErrors. Outside
    shard_map (no `mesh`), a function that names mesh axes raises _NeedsMeshAxes instead."""
    import jax

    try:
        out = fn(*args)
        jax.block_until_ready(out)
        return out
    except NameError as e:
        if "unbound axis name" not in str(e):
            raise UserCodeError(f"--fn {t.text}: raised NameError {where}: {first_line(e)}") from None
        if mesh is None:
            raise _NeedsMeshAxes(first_line(e)) from None
        raise UserCodeError(
            f"--fn {t.text}: raised NameError {where} over the mesh axes "
            f"{', '.join(mesh.axis_names)}: {first_line(e).rstrip('.')}; give --mesh with the axes "
            "it names"
        ) from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - whatever the user's function raises is reported
        raise UserCodeError(f"--fn {t.text}: raised {type(e).__name__} {where}: {first_line(e)}") from None


def _leaves(t: CodeRef, y, rows: int) -> list:
    """The output's arrays; each must have the batch as its first axis, so it can be sharded like x."""
    import jax

    leaves = jax.tree.leaves(y)
    if not leaves:
        raise UserCodeError(
            f"--fn {t.text}: returned {type(y).__name__} with no arrays; shard-check needs an "
            "output whose first axis is the batch"
        )
    for leaf in leaves:
        shape = getattr(leaf, "shape", None)
        if shape is None or len(shape) == 0 or shape[0] != rows:
            what = f"shape {tuple(shape)}" if shape is not None else f"a {type(leaf).__name__}"
            raise UserCodeError(
                f"--fn {t.text}: returned {what}; shard-check needs outputs whose first axis is "
                f"the batch, as x's ({rows})"
            )
    return leaves


def _preview(a: np.ndarray) -> list:
    flat = np.asarray(a).reshape(-1)[:PREVIEW]
    if flat.dtype == np.bool_:
        return flat.tolist()
    if np.issubdtype(flat.dtype, np.integer):
        return flat.astype(np.int64).tolist()
    return [float(v) if np.isfinite(v) else str(v) for v in flat.astype(np.float64)]


def _device_slices(y, mesh) -> tuple[list[dict], list[bytes]]:
    """Each device's block of the output, in mesh order: what the report shows of it (the first leaf's rows
    and values), and the bytes of its blocks of every leaf, to compare."""
    import jax

    leaves = jax.tree.leaves(y)
    by_device = [{s.device.id: s for s in leaf.addressable_shards} for leaf in leaves]
    shown, blobs = [], []
    for d in mesh.devices.flat:
        datas = [np.asarray(m[d.id].data) for m in by_device]
        idx = by_device[0][d.id].index[0]
        stop = leaves[0].shape[0] if idx.stop is None else idx.stop
        shown.append(
            {
                "device": int(d.id),
                "rows": [int(idx.start or 0), int(stop)],
                "values": _preview(datas[0]),
                "size": int(datas[0].size),
            }
        )
        blobs.append(b"".join(a.tobytes() for a in datas))
    return shown, blobs


def _groups(slices: list[dict], blobs: list[bytes]) -> list[list[int]]:
    """Devices whose blocks are identical, in groups of two or more."""
    seen: dict = {}
    for s, blob in zip(slices, blobs):
        seen.setdefault(blob, []).append(s["device"])
    return [ids for ids in seen.values() if len(ids) > 1]


def _fn_input(r: ShardRequest, n: int) -> np.ndarray:
    """x: ones, or a NumPy normal sample seeded by --seed; its first axis is the batch."""
    shape = r.shape or (n, 1)
    if shape[0] % n:
        raise UsageError(
            f"--shape {','.join(map(str, shape))}: the first axis of x is the batch; {shape[0]} rows do "
            f"not divide over {n} devices"
        )
    if r.fill == "ones":
        return np.ones(shape, np.float32)
    return np.random.default_rng(r.seed).standard_normal(shape).astype(np.float32)


def _fn_key(r: ShardRequest, device):
    """The key --seed or --key names, as a typed key of the default PRNG impl, on `device`."""
    import jax

    expr = parse_key_expr(r.key, Location("--key", 1, 1))
    width = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape[-1]
    raw = raw_words(expr)
    if raw is not None and len(raw) != width:
        raise UsageError(
            f"--key {r.key}: raw key data of {len(raw)} words; keys of the default PRNG impl "
            f"({jax_setting('jax_default_prng_impl')}) have {width}"
        )
    with jax.default_device(device):
        return evaluate(expr, JaxKeys(None))


def check_fn(t: CodeRef, r: ShardRequest, mesh) -> TargetResult:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    devices = list(mesh.devices.flat)
    with jax.default_device(devices[0]):  # arrays the module makes on import live on the devices checked
        fn = load_function(t)
    n, names = len(devices), tuple(mesh.axis_names)
    x = _fn_input(r, n)
    rows = len(x) // n
    key = _fn_key(r, devices[0])
    batch, replicated = rows_sharding(mesh), NamedSharding(mesh, PartitionSpec())
    axes_text = mesh_text(tuple(zip(names, mesh.devices.shape)))
    info = {
        "fn": t.text,
        "x": {
            "shape": list(x.shape),
            "dtype": "float32",
            "fill": r.fill,
            "seed": r.seed if r.fill == "normal" else None,
        },
        "key": {
            "expr": r.key,
            "impl": str(jax.random.key_impl(key)),
            "data": [int(w) for w in np.asarray(jax.random.key_data(key)).reshape(-1)],
        },
        "batch_partition": partition_text(batch.spec),
        "rows_per_device": rows,
        "eager_device": int(devices[0].id),
        "atol": r.atol,
        "replicated_key": r.replicated_key,
        "mesh_axes_only": False,
        "outputs": None,
    }

    try:
        with jax.default_device(devices[0]):
            eager = _call(t, "when run eagerly on one device", fn, key, jax.device_put(x, devices[0]))
    except _NeedsMeshAxes as e:
        info["mesh_axes_only"] = True
        jit_check = Check(
            "jit_equals_eager",
            "jit equals eager",
            NOT_APPLICABLE,
            f"the function names mesh axes ({e}), so it runs only inside shard_map",
        )
    else:
        eager_leaves = [np.asarray(v) for v in _leaves(t, eager, len(x))]
        info["outputs"] = [{"shape": list(v.shape), "dtype": str(v.dtype)} for v in eager_leaves]
        jitted = jax.jit(fn, in_shardings=(replicated, batch), out_shardings=batch)
        out = _call(
            t,
            f"under jax.jit with the batch sharded over {axes_text}",
            jitted,
            jax.device_put(key, replicated),
            jax.device_put(x, batch),
            mesh=mesh,
        )
        jit_check = _jit_check(eager_leaves, _leaves(t, out, len(x)), r.atol, n, axes_text)

    # under shard_map every device gets the same rows of x, so only the keys can make devices differ
    x_same = jax.device_put(np.concatenate([x[:rows]] * n), batch)
    smap = shard_map()
    split_fn = smap(
        lambda kb, xb: fn(kb[0], xb),
        mesh=mesh,
        in_specs=(PartitionSpec(names), PartitionSpec(names)),
        out_specs=PartitionSpec(names),
    )
    with jax.default_device(devices[0]):
        keys = jax.random.split(key, n)
    y = _call(t, "under shard_map with split keys", jax.jit(split_fn), jax.device_put(keys, batch), x_same, mesh=mesh)
    _leaves(t, y, len(x))
    split_check = _split_check(*_device_slices(y, mesh), n)

    one_fn = smap(fn, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec(names)), out_specs=PartitionSpec(names))
    y = _call(
        t,
        "under shard_map with one replicated key",
        jax.jit(one_fn),
        jax.device_put(key, replicated),
        x_same,
        mesh=mesh,
    )
    _leaves(t, y, len(x))
    one_check = _replicated_check(*_device_slices(y, mesh), n, r.replicated_key, r.allow_replicated, names)
    return TargetResult("fn", t.text, info, (jit_check, split_check, one_check))


ROUNDING_ULP = 16  # XLA fuses float operations differently under jit (e.g. into fused multiply-adds): each
# value may move by a few units in the last place of the values it is computed from


def _jit_check(eager: list, jitted: list, atol: float | None, n: int, axes_text: str) -> Check:
    """jit with the batch sharded against eager on one device. atol None: values may differ by XLA's rounding
    (never by different random values); a number: by that much (0: bit for bit)."""
    title = "jit equals eager"
    differ, bits, elements, max_diff = 0, 0, 0, 0.0
    max_ulp: int | None = 0
    for a, b in zip(eager, jitted):
        b = np.asarray(b)
        d = compare(a, b)  # bit for bit; the largest difference and ulp distance do not depend on a tolerance
        bits += d["mismatched"]
        if atol is None:
            differ += beyond_rounding(a, b, ROUNDING_ULP)
        else:
            differ += compare(a, b, atol)["mismatched"] if atol else d["mismatched"]
        elements += a.size
        max_diff = max(max_diff, d["max_abs_diff"] or 0.0)
        max_ulp = None if max_ulp is None or d["max_ulp"] is None else max(max_ulp, d["max_ulp"])
    blocks = distinct_blocks(jitted[0])
    details = {
        "elements": elements,
        "mismatched": differ,
        "not_bitwise_equal": bits,
        "max_abs_diff": max_diff,
        "max_ulp": max_ulp,
        "atol": atol,
        "tolerance": "rounding" if atol is None else "atol",
        "output_blocks": blocks,
        "eager": _preview(eager[0]),
        "jit": _preview(np.asarray(jitted[0])),
    }
    ulp = f", {max_ulp} ulp" if max_ulp is not None else ""
    if differ:
        if atol is None:
            why = (
                f" They are larger than rounding (more than {ROUNDING_ULP} units in the last place of the output's "
                "scale): the jitted, sharded run computes different values, e.g. different random values."
            )
        elif max_ulp is not None and max_ulp <= ROUNDING_ULP:
            why = (
                " These are rounding differences, not different random values: XLA fuses float operations "
                "differently under jit (e.g. into fused multiply-adds); without --atol they are accepted."
            )
        else:
            why = " They are larger than rounding: the jitted, sharded run computes different values."
        return Check(
            "jit_equals_eager",
            title,
            FAIL,
            f"under jax.jit with the batch sharded over {axes_text}, "
            f"{differ} of {elements} output values differ from the eager run on one device (largest "
            f"difference {max_diff:.3g}{ulp}{'' if not atol else f', atol {atol:g}'}).{why}",
            details,
        )
    if atol == 0 or not bits:
        how = f"bit for bit ({elements} values, "
    else:
        within = "up to XLA's rounding" if atol is None else f"within atol {atol:g}"
        how = f"{within}: {bits} of {elements} values differ, by at most {max_diff:.3g}{ulp} ("
    return Check(
        "jit_equals_eager",
        title,
        PASS,
        f"jax.jit with the batch sharded over {axes_text} gives the eager output {how}in {blocks} blocks on {n} "
        "devices)",
        details,
    )


def _split_check(slices: list[dict], blobs: list[bytes], n: int) -> Check:
    title = "shard_map, split keys"
    groups = _groups(slices, blobs)
    details = {"slices": slices, "identical_groups": groups}
    if n == 1:
        return Check("shard_map_split_keys", title, PASS, "one device: no other device to differ from", details)
    if groups:
        return Check(
            "shard_map_split_keys",
            title,
            FAIL,
            f"{sum(map(len, groups))} of {n} devices drew the same values as another device although each "
            f"got its own key from jax.random.split(key, {n}): {_group_text(groups)}; the output does not "
            "depend on the key there",
            details,
        )
    return Check(
        "shard_map_split_keys",
        title,
        PASS,
        f"each of the {n} devices drew its own values from its own key (jax.random.split(key, {n}), one per device)",
        details,
    )


def _group_text(groups: list[list[int]]) -> str:
    return "; ".join("devices " + ", ".join(map(str, g)) + " alike" for g in groups)


def _replicated_check(
    slices: list[dict], blobs: list[bytes], n: int, replicated: bool, allowed: bool, names: tuple[str, ...]
) -> Check:
    """shard_map(fn) given one replicated key. Equal device slices are the finding only when the function is
    called that way (--replicated-key); otherwise the function takes per-device keys, and this is information."""
    title = "shard_map, one key"
    groups = _groups(slices, blobs)
    details = {"slices": slices, "identical_groups": groups, "replicated_key": replicated, "allow_replicated": allowed}
    if n == 1:
        return Check("shard_map_replicated_key", title, PASS, "one device: no other device to repeat it", details)
    if not groups:
        return Check(
            "shard_map_replicated_key",
            title,
            PASS,
            f"given one replicated key, the {n} devices still drew "
            "different values: the function makes per-device randomness itself",
            details,
        )
    every = len(groups) == 1 and len(groups[0]) == n
    what = (
        f"{'both' if n == 2 else f'all {n}'} devices drew identical values from one replicated key"
        if every
        else f"from one replicated key, {_group_text(groups)}"
    )
    axes = repr(names[0]) if len(names) == 1 else "(" + ", ".join(map(repr, names)) + ")"
    finding = "same randomness on every device" if every else "same randomness on several devices"
    fix = (
        f"pass each device its own key (jax.random.split(key, {n}) with in_specs P({axes})) or fold in the "
        f"device index (jax.random.fold_in(key, jax.lax.axis_index({axes})))"
    )
    if allowed:
        return Check(
            "shard_map_replicated_key", title, ALLOWED, f"{finding}: {what} (intended: --allow-replicated)", details
        )
    if not replicated:
        return Check(
            "shard_map_replicated_key",
            title,
            INFO,
            f"{what}: the function makes no per-device randomness itself, so its callers must {fix}. "
            "A finding only if it is called with one replicated key (say so with --replicated-key)",
            details,
        )
    return Check(
        "shard_map_replicated_key",
        title,
        FINDING,
        f"{finding}: {what}, and the function is called that way (--replicated-key). {fix[0].upper()}{fix[1:]}",
        details,
    )
