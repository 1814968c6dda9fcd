"""`derive` reports as versioned, deterministic JSON (format `rngaudit.derive`, version 1) and JSON lines."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from .. import __version__
from ..engine.derive import DeriveReport, KeyedCall, TableCalls
from .halves import in_two
from .json_text import indented
from .table_records import CHUNK, Layout, nnx_records, slot, table_records

if TYPE_CHECKING:  # (an NNX spec's report: imported where one is written, a Linen run imports none of it)
    from ..engine.nnx import NnxDeriveReport, NnxKeyedCall

JSON_FORMAT = "rngaudit.derive"
JSON_FORMAT_VERSION = 1


def _values_json(v: np.ndarray):
    if v.dtype == np.bool_:
        return v.tolist()
    if np.issubdtype(v.dtype, np.integer):
        return v.astype(np.int64).tolist()
    f = v.astype(np.float64)
    if np.isfinite(f).all():
        return f.tolist()
    # JSON has no NaN or infinities (Python's encoder writes bare NaN, which parsers refuse): as strings, the way
    # protobuf's JSON mapping writes them
    out = f.astype(object)
    out[np.isnan(f)] = "NaN"
    out[f == np.inf] = "Infinity"
    out[f == -np.inf] = "-Infinity"
    return out.tolist()


def _drawn_json(draw, values: np.ndarray) -> dict:
    return {
        "draw": draw.describe(),
        "kind": draw.kind,
        "shape": list(draw.shape),
        "dtype": draw.dtype,
        "data": _values_json(values),
    }


def call_json(c: KeyedCall) -> dict:
    d = c.derivation
    out = {
        "index": d.index,
        "path": list(d.path),
        "path_str": d.path_str,
        "stream_requested": d.stream_requested,
        "stream": d.stream,
        "fallback": d.fallback,
        "count": d.count,
        "kind": d.kind,
        "label": d.label,
        "hash_items": list(d.hash_items),
        "hash_input_hex": d.hash_input.hex(),
        "hash_word": d.hash_word,
        "base": str(d.base) if d.base is not None else None,
        "key": list(c.key) if c.key is not None else None,
        "lane": list(d.lane),
        "discarded": d.discarded,
        "notes": list(d.notes),
        "location": d.location.as_json(),
    }
    if c.values is not None:
        assert c.draw is not None  # (values are drawn for a draw)
        out["values"] = _drawn_json(c.draw, c.values)
    return out


def _meta(report: DeriveReport) -> dict:
    spec = report.spec
    return {
        "format": JSON_FORMAT,
        "format_version": JSON_FORMAT_VERSION,
        "rngaudit_version": __version__,
        "spec": spec.file,
        "phase": spec.phase,
        "rules": spec.rules.name,
        "flax": {"fix_rng_separator": spec.fix_rng_separator, **spec.rules.as_json(), "version": spec.flax_version},
        "jax": {
            "prng_impl": spec.prng_impl,
            "threefry_partitionable": spec.threefry_partitionable,
            "version": spec.jax_version,
        },
        "rngs": {s: {"expr": spec.rngs[s].text, "key": list(report.roots[s])} for s in sorted(spec.rngs)},
    }


def _summary(report: DeriveReport | NnxDeriveReport) -> dict:
    out = {"calls": len(report.calls), "fallbacks": report.fallbacks, "discarded": report.discarded}
    if report.total is not None:
        out["selected_from"] = report.total
    return out


def to_json(report: DeriveReport | NnxDeriveReport) -> dict:
    if not isinstance(report, DeriveReport):
        return {**_nnx_meta(report), "calls": [nnx_call_json(c) for c in report.calls], "summary": _summary(report)}
    return {
        **_meta(report),
        "calls": [call_json(c) for c in report.calls],
        "summary": _summary(report),
        **_to_linen(report),
    }


def to_linen_json(run) -> dict:
    """One bridge.ToLinen call: where, the streams of the nnx.Rngs its NNX module is built from (each the key of a
    make_rng call of the report, `call`: its index, or ToLinen's constant `default` at apply) and every key the
    module's streams hand out (NNX call records: step 0 its construction, 1 its call)."""
    site = run.site
    nreport = run.report
    return {
        "path": list(site.path),
        "call": site.call,
        **({"lane": list(run.lane)} if run.lane else {}),
        "phase": "init" if site.init else "apply",
        "location": site.location.as_json(),
        "module": nreport.spec.model.cls,
        "rules": nreport.rules,
        "rngs": {
            s: {"expr": nreport.spec.rngs[s].text, "key": list(nreport.roots[s]), "call": row} for s, row in run.streams
        },
        "calls": [nnx_call_json(c) for c in nreport.calls],
    }


def _to_linen(report: DeriveReport) -> dict:
    """`to_linen`: the bridge.ToLinen calls, only in a report that has some."""
    return {"to_linen": [to_linen_json(run) for run in report.to_linen]} if report.to_linen else {}


def json_chunks(report: DeriveReport | NnxDeriveReport, advance=None):
    """`--format json`, written as it is encoded (flat memory): byte for byte `dumps(to_json(report))`. The calls
    of a Linen replay come from the columns, each record laid out from its template's text encoded once
    (indented_call_records); others are encoded one at a time, the same way."""
    calls = report.calls
    meta = {**_meta(report), **_to_linen(report)} if isinstance(report, DeriveReport) else _nnx_meta(report)
    encoder = json.JSONEncoder(sort_keys=True, indent=2, ensure_ascii=False)
    head, tail = encoder.encode({**meta, "calls": _CALLS, "summary": _summary(report)}).split(json.dumps(_CALLS))
    yield head
    if not len(calls):
        yield "[]"
    else:
        if isinstance(calls, TableCalls) or not isinstance(report, DeriveReport):
            # laid out from the replay's columns, a template's (a block's) record encoded once
            yield "[\n" + _ITEM
            if not isinstance(report, DeriveReport):
                nnx = report.calls
                layout = _item_layout(lambda j: nnx_call_json(nnx[j]))
                chunks = in_two(
                    lambda a, b: nnx_records(nnx, layout, lambda x: _nnx_template(nnx.table.blocks[x]), a, b),
                    len(nnx),
                    CHUNK,
                )
            else:
                linen: TableCalls = calls  # type: ignore[assignment]
                item = _item_layout(lambda j: call_json(linen[j]))
                chunks = in_two(lambda a, b: table_records(linen, item, a, b), len(linen.rows), CHUNK)
            for text, rows in chunks:
                yield text
                if advance is not None:
                    advance(rows)
            yield "\n  ]" + tail + "\n"
            return
        else:  # (the plain engine's calls, one record at a time)
            records = (_nested(indented(call_json(c))) for c in calls)
        buf = ["[\n" + _ITEM]
        size = 0
        for j, record in enumerate(records):
            if j:
                buf.append(",\n" + _ITEM)
                if advance is not None and not j % 4096:
                    advance(4096)
            buf.append(record)
            size += len(record)
            if size >= 1 << 16:
                yield "".join(buf)
                buf, size = [], 0
        buf.append("\n  ]")
        yield "".join(buf)
    yield tail + "\n"


def _item_layout(record) -> Layout:
    """A call record as an item of the JSON document's calls list (indent 2, sorted keys); `record(j)`: row j's
    record, for the rows encoded whole."""
    return Layout(
        encode=lambda r: _nested(indented(r)),
        open="[\n" + _ITEM + "    ",
        between=",\n" + _ITEM + "    ",
        close="\n" + _ITEM + "  ]",
        lead=",\n" + _ITEM,
        end="",
        extra={},
        whole=lambda j: _nested(indented(record(j))),
    )


_CALLS = "\x00rngaudit:calls\x00"  # stands for the calls list while the rest of the document is encoded
_ITEM = " " * 4  # a call record's indent in the document (the calls list's items)


def _nested(text: str) -> str:
    """An object encoded on its own (indent 2) as an item of the calls list: each line after the first indented
    by the item's indent (JSON strings hold no raw newline)."""
    return text.replace("\n", "\n" + _ITEM)


# ---------------------------------------------------------------- NNX
def _nnx_meta(report: NnxDeriveReport) -> dict:
    spec = report.spec
    return {
        "format": JSON_FORMAT,
        "format_version": JSON_FORMAT_VERSION,
        "rngaudit_version": __version__,
        "spec": spec.file,
        "flavour": "nnx",
        "rules": report.rules,
        "flax": {"version": spec.flax_version},
        "steps": spec.steps,
        # (the steps made after model.eval(), where Dropout and attention draw nothing; only with train/eval events)
        **({"eval_steps": list(spec.eval_steps)} if spec.eval_steps is not None else {}),
        "jax": {
            "prng_impl": spec.prng_impl,
            "threefry_partitionable": spec.threefry_partitionable,
            "version": spec.jax_version,
        },
        "rngs": {s: {"expr": spec.rngs[s].text, "key": list(report.roots[s])} for s in sorted(spec.rngs)},
        **(
            {"call_rngs": {s: {"expr": spec.call_rngs[s].text} for s in sorted(spec.call_rngs)}}
            if spec.call_rngs
            else {}
        ),
        **(
            {
                "call_rngs_steps": [
                    None if given is None else {s: {"expr": given[s].text} for s in sorted(given)}
                    for given in spec.call_rngs_steps
                ]
            }
            if spec.call_rngs_steps
            else {}
        ),
    }


def nnx_call_lines(report: NnxDeriveReport, encode, start: int = 0, stop: int | None = None):
    """`{"record": "call", ...}` lines of an NNX report (its rows at positions start..stop-1): byte for byte what
    `encode` (sorted keys, compact) makes of nnx_call_json's objects, with what a block of consecutive draws fixes
    encoded once."""
    calls = report.calls
    table = calls.table
    consts: dict = {}
    rows = calls.rows()
    step = 1 << 15
    stop = len(rows) if stop is None else stop
    for j0 in range(start, stop, step):
        r = rows[j0 : min(j0 + step, stop)]
        for j, i, b, c, key in zip(
            range(j0, j0 + len(r)),
            r.tolist(),
            table.block[r].tolist(),
            table.count[r].tolist(),
            table.keys[r].tolist(),
        ):
            if j in calls.values:
                yield encode({"record": "call", **nnx_call_json(calls[j])})
                continue
            const = consts.get(b)
            if const is None:
                k = table.blocks[b]
                head = encode({"broadcast": k.broadcast or None, "chain": list(k.chain)})[1:-1]
                rest = encode(
                    {
                        "kind": k.kind,
                        "label": k.label,
                        "lane": None if k.lane < 0 else k.lane,
                        **({"linen": k.linen} if k.linen else {}),
                        **({"given": k.given} if k.given else {}),
                        "location": k.loc.as_json(),
                        "record": "call",
                        "site": k.site,
                        "step": k.step,
                        "stream": k.tag,
                        "stream_path": k.stream,
                        "stream_requested": k.requested,
                        **({"unused": True} if k.unused else {}),
                    }
                )[1:-1]
                it = "null" if k.iteration < 0 else str(k.iteration)
                const = consts[b] = (head, "true" if k.fallback else "false", it, rest)
            head, fallback, it, rest = const
            yield (
                f'{{{head},"count":{c},"fallback":{fallback},"index":{i},"iteration":{it},'
                f'"key":[{",".join(map(str, key))}],{rest}}}'
            )


def _lined(lines: Iterable[str]) -> Iterator[tuple[str, int]]:
    """Lines as (text, lines) chunks of 4096, each line ended."""
    chunk: list[str] = []
    for line in lines:
        chunk.append(line)
        if len(chunk) == 4096:
            yield "\n".join(chunk) + "\n", len(chunk)
            chunk = []
    if chunk:
        yield "\n".join(chunk) + "\n", len(chunk)


def _nnx_template(k) -> dict:
    """A block's call record with placeholders for what its rows differ in: count, index and key."""
    import copy

    d = copy.copy(k)
    object.__setattr__(d, "count", slot("count"))
    from ..engine.nnx import NnxKeyedCall

    out = nnx_call_json(NnxKeyedCall(d, (), None, None, slot("index")))  # type: ignore[arg-type]
    out["key"] = slot("key")
    return out


def nnx_call_json(c: NnxKeyedCall) -> dict:
    d = c.derivation
    out = {
        "index": c.index,
        "step": d.step,
        "site": d.site,
        "kind": d.kind,
        "label": d.label,
        "stream_requested": d.requested,
        "stream": d.tag,
        "stream_path": d.stream,
        "fallback": d.fallback,
        "count": d.count,
        "chain": list(d.chain),
        "key": list(c.key),
        "lane": None if d.lane < 0 else d.lane,
        "iteration": None if d.iteration < 0 else d.iteration,
        "broadcast": d.broadcast or None,
        "location": d.loc.as_json(),
    }
    if d.linen:
        out["linen"] = d.linen  # a bridge.ToNNX's Linen key: Linen hashed path and count into the drawn key
    if d.given:
        out["given"] = d.given  # a key given to a Dropout's call, used as it is
    if d.unused:
        out["unused"] = True  # an nnx.RNN's carry key, initialize_carry's with a zeros carry: handed out, not used
    if c.values is not None:
        assert c.draw is not None  # (values are drawn for a draw)
        out["values"] = _drawn_json(c.draw, c.values)
    return out


def jsonl_lines(report: DeriveReport | NnxDeriveReport, advance=None):
    """`--format jsonl`: one JSON object a line, made as it is written (flat memory): a `header`
    record (the JSON format's fields but calls and summary), one `call` record per call site (the
    JSON format's call objects), and a closing `summary` record."""
    dumps = json.JSONEncoder(ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode
    meta = _meta(report) if isinstance(report, DeriveReport) else _nnx_meta(report)
    yield dumps({"record": "header", **meta}) + "\n"
    chunks: Iterable[tuple[str, int]]
    if not isinstance(report, DeriveReport):
        chunks = in_two(lambda a, b: _lined(nnx_call_lines(report, dumps, a, b)), len(report.calls), 1)
    elif isinstance(report.calls, TableCalls):
        # the fast path: records laid out from the columns a chunk at a time
        calls = report.calls
        layout = Layout(
            encode=dumps,
            open="[",
            between=",",
            close="]",
            lead="",
            end="\n",
            extra={"record": "call"},
            whole=lambda j: dumps({"record": "call", **call_json(calls[j])}),
        )
        chunks = in_two(lambda a, b: table_records(calls, layout, a, b), len(calls.rows), CHUNK)
    else:
        chunks = _lined(dumps({"record": "call", **call_json(c)}) for c in report.calls)
    for text, rows in chunks:
        yield text
        if advance is not None:
            advance(rows)
    for run in report.to_linen if isinstance(report, DeriveReport) else ():
        yield dumps({"record": "to_linen", **to_linen_json(run)}) + "\n"
    yield dumps({"record": "summary", **_summary(report)}) + "\n"
