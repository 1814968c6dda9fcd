"""Turn what capture observed in Flax (calls, transforms, key events) into a spec in the project's format."""

from __future__ import annotations

import yaml

from ..errors import UnsupportedError

_CLASS_PREFIX = {
    "vmap": "Vmap",
    "scan": "Scan",
    "jit": "Jit",
    "remat": "Checkpoint",
    "fold_rngs": "Fold_rngs",
    "map_variables": "Map_variables",
    "remat_scan": "Remat_scan",
}
_FLOW = ("cond", "switch", "while_loop")  # lifted inside a method: statements of the body


def _class_levels(kinds: list[str], outer: str, inner: str) -> list[bool] | None:
    """Which lifted transforms (outermost first) are class transforms, each adding its prefix to the class
    name (nn.scan(nn.remat(Block)) is ScanCheckpointBlock), and which are method decorators (no prefix), such
    that the prefixes and `inner` spell `outer`; a class transform is preferred where both would. None when
    no assignment spells it."""
    if not kinds:
        return [] if outer == inner else None
    prefix = _CLASS_PREFIX.get(kinds[0])
    if prefix and outer.startswith(prefix) and len(outer) > len(prefix):
        rest = _class_levels(kinds[1:], outer[len(prefix) :], inner)
        if rest is not None:
            return [True, *rest]
    rest = _class_levels(kinds[1:], outer, inner)
    return None if rest is None else [False, *rest]


def _remat_scan(run: list) -> tuple | None:
    """nn.remat_scan(Block, lengths=(a, b, ...)) as Flax runs it: scan(a) of remat of scan(b) ... (flax/core/lift.py
    remat_scan): `run`, those lifts, as one `remat_scan` lift with the lengths; None if they are not that (the scans'
    options alike but their lengths, each remat lifting every stream)."""
    scans = [opts for kind, opts, _ in run if kind == "scan"]
    if any(opts != {"rngs": "all"} for kind, opts, _ in run if kind == "remat"):
        return None
    shared = [{k: v for k, v in opts.items() if k != "length"} for opts in scans]
    if any(o != shared[0] for o in shared) or shared[0].get("check_constancy_invariants") is not True:
        return None
    opts = {k: v for k, v in shared[0].items() if k != "check_constancy_invariants"}
    return ("remat_scan", {"lengths": [o["length"] for o in scans], **opts}, run[0][2])


def _foldings(lifts: list, limit: int = 64) -> list[list]:
    """`lifts` read with runs scan, remat, scan, ... folded into one remat_scan lift, every way (the first reading
    folds nothing), at most `limit` readings."""
    if not lifts:
        return [[]]
    out = [[lifts[0], *rest] for rest in _foldings(lifts[1:], limit)]
    j = 1
    while lifts[0][0] == "scan" and len(out) < limit:
        folded = _remat_scan(lifts[:j])
        if folded is not None:
            out += [[folded, *rest] for rest in _foldings(lifts[j:], limit)]
        if j + 1 < len(lifts) and lifts[j][0] == "remat" and lifts[j + 1][0] == "scan":
            j += 2
        else:
            break
    return out[:limit]


_REPEATABLE = ("module", "vmap", "scan", "jit", "fold_rngs", "remat", "checkpoint", "map_variables", "remat_scan")


def _compress(stmts: list) -> list:
    """Runs of identical statements as one with `repeat: N`: auto-named modules (and transformed ones) made
    and called in a row, and calls of one child in a row, as the spec format reads `repeat`. So a captured
    stack of 96 identical blocks is one block long."""
    out: list = []
    runs: list[int] = []
    for st in stmts:
        if out and runs[-1] and st == out[-1]:
            runs[-1] += 1
            continue
        out.append(st)
        runs.append(1 if _repeatable(st) else 0)
    return [_with_repeat(st, n) if n > 1 else st for st, n in zip(out, runs)]


def _repeatable(st) -> bool:
    if not isinstance(st, dict) or len(st) != 1:
        return False
    ((kind, body),) = st.items()
    if kind == "call":
        return isinstance(body, str)
    return kind in _REPEATABLE and isinstance(body, dict) and "name" not in body and "repeat" not in body


def _with_repeat(st: dict, n: int) -> dict:
    ((kind, body),) = st.items()
    if kind == "call":
        return {"call": {"name": body, "repeat": n}}
    if kind == "module":
        head = {k: body[k] for k in ("class",) if k in body}
        return {"module": {**head, "repeat": n, **{k: v for k, v in body.items() if k not in head}}}
    return {kind: {**body, "repeat": n}}


def _kind(x) -> str:
    return type(x).__name__


def _is_lift(x) -> bool:
    """A class transform (or method decorator) around the module's method, not an nn.cond/switch/while_loop."""
    return _kind(x) == "LiftNode" and x.kind not in _FLOW


def _is_flow(x) -> bool:
    return _kind(x) == "LiftNode" and x.kind in _FLOW


class _Unsupported(UnsupportedError):
    pass


def _filter(f, what: str):
    """A Flax filter as the spec writes it."""
    if f is True:
        return "all"
    if f is False or f is None:
        return "none"
    if isinstance(f, str):
        return f
    if isinstance(f, (tuple, list)) and all(isinstance(x, str) for x in f):
        return list(f)
    raise _Unsupported(f"capture cannot write the filter {f!r} of {what} (only names, lists of names, True and False)")


def _mapping(d, what: str) -> dict:
    out = {}
    for k, v in (d or {}).items():
        key = _filter(k, what)
        if isinstance(key, list):
            for name in key:
                out[name] = v
        else:
            out[key] = v
    return out


def _lift_options(node) -> dict:
    o = node.options
    if node.kind == "vmap":
        if o.get("axis_size") is None:
            raise _Unsupported("nn.vmap whose axis size cannot be told from its inputs")
        return {
            "axis_size": int(o["axis_size"]),
            "split_rngs": _mapping(o["split_rngs"], "split_rngs"),
            "variable_axes": _mapping(o["variable_axes"], "variable_axes"),
        }
    if node.kind == "scan":
        if o.get("length") is None:
            raise _Unsupported("nn.scan whose length cannot be told from its inputs")
        return {
            "length": int(o["length"]),
            "split_rngs": _mapping(o["split_rngs"], "split_rngs"),
            "variable_axes": _mapping(o["variable_axes"], "variable_axes"),
            "variable_broadcast": _filter(o["variable_broadcast"], "variable_broadcast"),
            "variable_carry": _filter(o["variable_carry"], "variable_carry"),
            "check_constancy_invariants": bool(o["check_constancy_invariants"]),
        }
    if node.kind == "map_variables":
        out = {
            "rngs": _filter(o["rngs"], "rngs"),
            "init": bool(o["init"]),
            "mutable": bool(o["mutable"]),
            "mapped_collections": _filter(o["mapped_collections"], "mapped_collections"),
        }
        if o["variables"] is not True:
            out["variables"] = _filter(o["variables"], "variables")
        return out
    return {"rngs": _filter(o["rngs"], "rngs")}


_LEAF_STATEMENTS = ("param", "make_rng", "variable")


def _draws_of(items: list) -> list:
    """What a module-form body draws, in order, as (kind, name): what a layer statement must reproduce."""
    out = []
    for st in items:
        if not isinstance(st, dict) or len(st) != 1:
            return [None]
        ((kind, arg),) = st.items()
        if kind not in _LEAF_STATEMENTS:
            return [None]  # a child, a call, a transform: not a standard layer's own body
        out.append((kind, arg if not isinstance(arg, dict) else tuple(sorted(arg.items(), key=str))))
    return out


class _Builder:
    def __init__(self, rec, phase: str, layers: bool = False, excluded: frozenset = frozenset()):
        self.rec = rec
        self.phase = phase
        self.layers = layers  # write Flax's standard layers as layer statements with their hyper-parameters
        self.excluded = excluded  # module paths written as modules whatever their class

    def layer_statement(self, inner, name: str | None, body: dict) -> dict | None:
        """`{Dense: {features: 4, use_bias: false}}` for a standard layer whose module form drew only its own keys;
        None when it is not one (capture replays the spec and writes such a module as a module where the layer
        statement would not reproduce Flax)."""
        from ..spec.layers import LAYERS, OPTION_TYPES

        kind = LAYERS.get(inner.cls)
        info = self.rec.modules.get(inner.path)
        if kind is None or info is None or not inner.path or inner.path in self.excluded:
            return None
        if not info.origin.startswith("flax.linen."):
            return None  # a class of the user's own that is called Dense
        setup, items = body.get("setup", []), body.get("body", [])
        drawn = _draws_of(setup) + _draws_of(items)
        if None in drawn:
            return None
        if any(k == "param" and a not in kind.params for k, a in drawn):
            return None
        if any(k != "param" and isinstance(a, tuple) and ("stream", "params") in a for k, a in drawn):
            return None  # a parameter made by apply (or a variable's initialiser): a layer's params draw in init only
        opts: dict = {} if name is None else {"name": name}
        for opt in kind.passive:
            v = info.options.get(opt)
            if v is not None:
                opts[opt] = v
        for opt, default in kind.options.items():
            v = info.options.get(opt, default)
            if opt == "deterministic" and v is None:
                v = not any(k == "make_rng" for k, _ in drawn)  # (given at the call: what the call did)
            want = OPTION_TYPES.get(opt)
            if want is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if v is None or (want is not None and not isinstance(v, want)) or (want is not bool and v is True):
                return None
            if v != default or opt in ("rate", "deterministic"):
                opts[opt] = v
        return {inner.cls: opts}

    def setup_of(self, node):
        """The setup() run that prepared this call: the latest one at the same path before it."""
        best = None
        for s in self.rec.setups:
            if s.path == node.path and s.seq < node.seq:
                best = s
        return best

    def unwrap(self, node):
        """(lifts outermost first as (kind, options, class at that level), the innermost call node)."""
        lifts = []
        while True:
            lift_nodes = [x for x in node.items if _is_lift(x)]
            if not lift_nodes:
                return lifts, node
            others = [
                x
                for x in node.items
                if _kind(x) in ("Event", "CallNode") or _is_flow(x)
                if not (_kind(x) == "CallNode" and x.method == "setup")
            ]
            if len(lift_nodes) > 1 or others:
                raise _Unsupported(
                    f"module {'/'.join(node.path) or '(root)'} mixes a lifted transform with other "
                    "work in the same method"
                )
            ln = lift_nodes[0]
            if not ln.traces:
                where = "/".join(node.path) or "(root)"
                raise _Unsupported(
                    f"nn.{ln.kind} at {where} ran without tracing its body"
                    + (
                        " (JAX reused the trace of another instance of the same jitted class, nn.jit's cache, so "
                        "capture saw none of its draws: make the class with nn.jit(Block) where each instance is "
                        "made, or write that part of the spec by hand)"
                        if ln.kind == "jit"
                        else ""
                    )
                )
            lifts.append((ln.kind, _lift_options(ln), node.cls))
            inner = [
                x
                for x in ln.traces[0].items
                if type(x).__name__ == "CallNode" and x.path == node.path and x.method != "setup"
            ]
            if len(inner) != 1:
                raise _Unsupported(
                    f"the body of nn.{ln.kind} at {'/'.join(node.path) or '(root)'} is not one call of the module"
                )
            node = inner[0]

    def module(self, node, name: str | None, define: bool = False) -> dict:
        """The statement for the module whose (first) call is `node`."""
        lifts, inner = self.unwrap(node)
        body = {"class": inner.cls}
        setup = self.setup_of(inner)
        defined: list[str] = []
        items: list = []
        if setup is not None:
            items, defined = self.setup_items(setup, inner)
        # children Flax adopted from the module's dataclass fields (nn.Sequential(layers=[...])) are bound while
        # it sets up, before its setup() runs: a spec defines them in setup too, so a second call of the module
        # reuses them (and their setup() draws once) instead of making them anew as a compact body would
        firsts = self.first_calls(inner)
        adopted = [
            name
            for name in firsts
            if name not in defined
            and (info := self.rec.modules.get(inner.path + (name,))) is not None
            and info.naming == "setup"
        ]
        if adopted:
            items = [self.module(firsts[name], name) for name in adopted] + items
            defined = adopted + defined
        if items:
            body["setup"] = items
        body["body"] = self.body(inner, set(defined))
        if self.layers and not lifts:
            layer = self.layer_statement(inner, name, body)
            if layer is not None:
                return layer
        # class transforms rename the class (VmapMLP, nested: ScanCheckpointBlock); a method decorator keeps it
        # the readings of the lifts that spell the class name (nn.remat_scan runs as scans and remats; its class,
        # Remat_scanBlock, names it), method decorators after every class transform (the innermost class's): the
        # one with the fewest method decorators, then the fewest lifts
        readings = []
        for reading in _foldings(lifts):
            levels = _class_levels([kind for kind, _, _ in reading], lifts[0][2] if lifts else inner.cls, inner.cls)
            if levels is not None and levels == sorted(levels, reverse=True):
                readings.append((levels.count(False), len(reading), reading, levels))
        classes: list[bool] | None
        if readings:
            _, _, lifts, classes = min(readings, key=lambda r: r[:2])
        else:  # (none: the lifts as they are, whose error below says what is wrong)
            classes = _class_levels([kind for kind, _, _ in lifts], lifts[0][2] if lifts else inner.cls, inner.cls)
        if classes is None:
            raise _Unsupported(f"cannot tell how {lifts[0][2]} wraps {inner.cls}")
        stmt = body
        decorators: list = []
        for i in range(len(lifts) - 1, -1, -1):
            kind, opts, _ = lifts[i]
            if classes[i]:
                if decorators:  # (method decorators inside a class transform belong to the class it wraps)
                    stmt["transforms"] = decorators
                    decorators = []
                stmt = {kind: dict({"module": stmt}, **opts)}
            else:
                if not isinstance(stmt, dict) or "class" not in stmt:
                    raise _Unsupported(
                        f"a method decorator outside a class transform at {'/'.join(node.path) or '(root)'}"
                    )
                decorators.insert(0, {kind: opts})
        if decorators:
            stmt["transforms"] = decorators
        if "class" in stmt:
            if name is not None:
                stmt = dict({"class": stmt["class"], "name": name}, **{k: v for k, v in stmt.items() if k != "class"})
            return {"module": stmt}
        if name is not None:
            ((kind, opts),) = stmt.items()
            stmt = {kind: dict(opts, name=name)}
        return stmt

    def _setup_draws(self, call) -> bool:
        setup = self.setup_of(call)
        return setup is not None and any(not isinstance(x, tuple) for x in setup.items)

    def setup_items(self, setup, call) -> tuple[list, list[str]]:
        out: list = []
        defined: list[str] = []
        firsts = self.first_calls(call)
        pending_var = None
        for item in setup.items:
            if isinstance(item, tuple) and item[0] == "define":
                pending_var = None
                name = item[1]
                defined.append(name)
                child = firsts.get(name)
                if child is None:
                    info = self.rec.modules.get(setup.path + (name,))
                    cls = info.cls if info is not None else "Module"
                    out.append({"module": {"class": cls, "name": name, "body": []}})
                else:
                    stmt = self.module(child, name)
                    out.append(stmt)
            else:
                pending_var = _add_event(out, self.own(item, setup), item, pending_var)
        return out, defined

    def first_calls(self, call, out=None) -> dict:
        """The first call of each child of `call`'s module, also inside its nn.cond/switch/while_loop
        branches (which run at the module's scope)."""
        out = {} if out is None else out
        for x in call.items:
            if _kind(x) == "CallNode" and x.method != "setup" and x.path == call.path:
                self.first_calls(x, out)  # another method of the module, called from a branch
            elif _kind(x) == "CallNode" and x.method != "setup" and x.path[:-1] == call.path:
                out.setdefault(x.path[-1], x)
            elif _is_flow(x):
                for trace in x.traces:
                    self.first_calls(_At(trace.items, call.path), out)
        return out

    def own(self, ev, node) -> list:
        if type(ev).__name__ == "CallNode":
            raise _Unsupported(f"module {'/'.join(ev.path)} is called from its parent's setup()")
        if type(ev).__name__ != "Event":
            raise _Unsupported(f"a lifted transform inside the setup() of {'/'.join(node.path) or '(root)'}")
        if ev.fork:
            return []
        if ev.init_col == "params" and self.phase == "init":
            return [{"param": ev.var_name}]
        if ev.init_col == "params":
            return [{"make_rng": {"stream": "params", "label": ev.var_name}}]
        if ev.init_col is not None and self.phase == "init":
            return [{"variable": {"collection": ev.init_col, "name": ev.var_name, "make_rng": ev.requested}}]
        if ev.init_col is not None:
            return [{"make_rng": {"stream": ev.requested, "label": ev.var_name}}]
        return [{"make_rng": ev.requested}]

    def body(self, node, defined: set) -> list:
        return self.statements(node.items, node.path, defined, {}, set())

    def statements(self, items, path: tuple, defined: set, cursor: dict, seen: set) -> list:
        """The statements for what a method of the module at `path` did; `cursor` (auto-name counters)
        and `seen` (children made so far) carry on as Flax's do."""
        out: list = []
        pending_var = None
        node = _At(items, path)
        deferred: set = set()
        for item in items:
            kind = _kind(item)
            if kind == "CallNode":
                if item.method == "setup":
                    continue  # a branch runs on a clone of the module, which runs setup() again
                if item.path == path:
                    # another method of the same module, called from an nn.cond/switch/while_loop branch
                    out.extend(self.statements(item.items, path, defined, cursor, seen))
                    pending_var = None
                    continue
                if id(item) in deferred:
                    continue  # this call defined the module where its key-less first call was
                name = item.path[-1]
                if name in defined or name in seen:
                    # a call that did nothing key-related (no draw, child or transform) is left out, unless it
                    # is the first call of a setup-defined module whose setup() draws (Flax runs it lazily there)
                    first = name in defined and name not in seen
                    seen.add(name)
                    if item.items or (first and self._setup_draws(item)):
                        out.append({"call": name})
                    continue
                seen.add(name)
                if not item.items:
                    # a key-less method called first (nn.RNN's cell.initialize_carry before cell(...)): the
                    # module is described by its first call that does something, where it was first called
                    later = next(
                        (
                            x
                            for x in items
                            if _kind(x) == "CallNode" and x.path == item.path and x.method != "setup" and x.items
                        ),
                        None,
                    )
                    if later is not None:
                        deferred.add(id(later))
                        item = later
                cls = item.cls
                n = cursor.get(cls, 0)
                info = self.rec.modules.get(item.path)
                if info is not None and info.naming == "auto" and name == f"{cls}_{n}":
                    cursor[cls] = n + 1
                    out.append(self.module(item, None))
                else:
                    out.append(self.module(item, name))
            elif kind == "Event":
                pending_var = _add_event(out, self.own(item, node), item, pending_var)
            elif _is_flow(item):
                out.append(self.flow(item, path, defined, cursor, seen))
                pending_var = None
            elif kind == "LiftNode":
                raise _Unsupported(
                    f"a lifted transform inside a method of {'/'.join(path) or '(root)'} that also does other work"
                )
        return _compress(out)

    def flow(self, node, path: tuple, defined: set, cursor: dict, seen: set) -> dict:
        """nn.cond / nn.switch / nn.while_loop as a statement: each branch (cond, body) traced in order, each
        starting from the module's auto-name cursor; afterwards the cursor is the last trace's
        (mirrors flax/linen/transforms.py decorator_lift_transform: every branch runs on a clone)."""
        where = "/".join(path) or "(root)"
        labels = [t.label for t in node.traces]
        if node.kind == "while_loop":
            if labels != ["cond", "body"]:
                raise _Unsupported(
                    f"nn.while_loop at {where} traced its cond and body {len(labels)} times "
                    f"({', '.join(map(str, labels))}), not once each (a carry whose dtype changes "
                    "in the body makes JAX trace it again); make the carry's dtypes stable"
                )
        elif labels != list(range(node.options["branches"])):
            raise _Unsupported(f"nn.{node.kind} at {where} traced its branches as {labels}, not once each in order")
        last = cursor
        parts = []
        for trace in node.traces:
            branch_cursor = dict(cursor)
            parts.append(self.statements(trace.items, path, defined, branch_cursor, set(seen)))
            last = branch_cursor
        cursor.clear()
        cursor.update(last)
        o = node.options
        if node.kind == "while_loop":
            counts = self.rec.loop_iterations.get(o["loop"], set())
            if len(counts) > 1:
                raise _Unsupported(
                    f"nn.while_loop at {where} ran {' or '.join(map(str, sorted(counts)))} times "
                    "(in different calls, lanes or steps); a spec has one iteration count per loop"
                )
            return {
                "while_loop": {
                    "cond": parts[0],
                    "body": parts[1],
                    "iterations": min(counts, default=0),
                    "split_rngs": _mapping(o["split_rngs"], "split_rngs"),
                }
            }
        stmt = {"true_fun": parts[0], "false_fun": parts[1]} if node.kind == "cond" else {"branches": parts}
        if o["rngs"] is not True:
            stmt["rngs"] = _filter(o["rngs"], "rngs")
        if o["variables"] is not True:
            stmt["variables"] = _filter(o["variables"], "variables")
        return {node.kind: stmt}


class _At:
    """What a method (or a branch of one) did at a module's scope: its items and the module's path."""

    def __init__(self, items, path):
        self.items = items
        self.path = path


def _add_event(out: list, stmts: list, ev, pending):
    """Append a key event's statements; several keys drawn while creating one variable make one `variable` with a
    list of streams (in setup() as in a method). A `param` draws one key: a second key for the same name was a
    `variable` of the params collection all along. Returns the variable being created, if any."""
    made = stmts[0] if len(stmts) == 1 else None
    kind = next(iter(made)) if isinstance(made, dict) else None
    if kind in ("variable", "param") and pending is not None and out and pending[:2] == (ev.init_col, ev.var_name):
        prev = out[-1]
        if "param" in prev:  # (the first key was taken for a param's)
            prev.pop("param")
            prev["variable"] = {"collection": ev.init_col, "name": ev.var_name, "make_rng": pending[2]}
        var = prev["variable"]
        streams = var["make_rng"] if isinstance(var["make_rng"], list) else [var["make_rng"]]
        var["make_rng"] = streams + [ev.requested]
        return pending
    out.extend(stmts)
    return (ev.init_col, ev.var_name, ev.requested) if kind in ("variable", "param") else None


def model_doc(rec, phase: str, target: str, layers: bool = False, excluded: frozenset = frozenset()) -> dict:
    """The `model:` of a spec that replays what `rec` observed (with `layers`, standard layers as layer
    statements, except at the `excluded` paths)."""
    roots = [x for x in rec.root.items if type(x).__name__ == "CallNode" and x.method != "setup"]
    # init(...) may first call a wrapper method that does nothing at the root's scope
    roots = [x for x in roots if x.items] or roots
    if not roots:
        raise UnsupportedError(f"capture of {target}: the model's {phase} called no module method")
    b = _Builder(rec, phase, layers, excluded)
    try:
        model = b.module(roots[0], None)
    except _Unsupported as e:
        raise UnsupportedError(f"capture of {target}: {e.message}; no spec was written") from None
    return model.get("module", model)


def build_spec(
    rec,
    root_cls: str,
    phase: str,
    seeds: dict,
    settings: dict,
    target: str,
    layers: bool = False,
    excluded: frozenset = frozenset(),
    method: str | None = None,
) -> str:
    """The YAML text of a spec that replays what `rec` observed (`method`: the module method the model ran, when
    not __call__)."""
    model = model_doc(rec, phase, target, layers, excluded)
    doc = {
        "rngaudit": 1,
        "flax": {"fix_rng_separator": settings["fix_rng_separator"], "version": settings["flax_version"]},
        "jax": jax_doc(settings),
        "phase": phase,
        **({"method": method} if method is not None else {}),
        "rngs": dict(seeds),
    }
    if phase == "apply" and rec.mutable:
        doc["mutable"] = sorted(rec.mutable)  # what capture applied the model with
    doc["model"] = model
    header = (
        f"# Captured by rngaudit capture {target} ({phase}) from real Flax; `rngaudit derive` on this\n"
        "# spec reproduces every key Flax handed out (checked before it was written).\n"
    )
    return header + yaml.dump(doc, Dumper=_PlainDumper, sort_keys=False, default_flow_style=None, width=100)


def jax_doc(settings: dict) -> dict:
    """A captured spec's `jax:` mapping: the release and the PRNG implementation, and `threefry_partitionable`
    only where the model set it against its release's default (jax.config.update(...)): a spec that states the
    flag pins it, so an upgrade check (`diff --from-jax/--to-jax`) would not move it."""
    from ..spec.releases import jax_partitionable_default, version_tuple

    doc = {"version": settings["jax_version"], "prng_impl": settings["prng_impl"]}
    try:
        default = jax_partitionable_default(version_tuple(settings["jax_version"]))
    except (TypeError, ValueError):
        default = None  # (a release rngaudit cannot read: the flag is written)
    if settings["threefry_partitionable"] != default:
        doc["threefry_partitionable"] = settings["threefry_partitionable"]
    return doc


class _PlainDumper(yaml.SafeDumper):
    """safe_dump without anchors and aliases: a statement used twice is written twice, so the spec reads as
    plain YAML and its node count is bounded by its length."""

    def ignore_aliases(self, data) -> bool:
        return True
