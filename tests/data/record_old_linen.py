"""Records the keys an older Flax Linen hands out for Linen specs that say `flax: {version: <that release>}`, as
the fixture tests/data/linen_old_flax.json that tests/engine/test_linen_versions.py compares derive with (and
that the upgrade check is compared with: the keys that differ between two recorded releases are the keys
`rngaudit diff --from-flax A --to-flax B` lists).

Run it with the older Flax installed (a separate virtualenv with a JAX of its era), from the repository root,
or let benchmarks/version_matrix.py make the virtualenvs and run it in each:

    python3 -m venv /tmp/f0101 && /tmp/f0101/bin/pip install flax==0.10.1 jax==0.4.35 jaxlib==0.4.35 \\
        pyyaml typer rich hypothesis pytest
    PYTHONPATH=.:tests /tmp/f0101/bin/python tests/data/record_old_linen.py

It adds (or replaces) that release's entry. Two kinds of case:
- oracle cases: the hand-written specs below and random ones drawn by the Linen property test's generators
  (which keep to what the release has), each with every key real Flax handed out, as tests/flax_oracle.py
  observes them (path, stream requested, stream used, count, lane, key), or the error it raised;
- probe cases: Linen models written out below whose every draw is visible in the variables (a param's value
  is its key's data, a make_rng's key is sown), each run in a fresh process: the models where jax reuses an
  nn.jit trace (flax 0.9.0 to 0.10.1), which the oracle cannot attribute, and where a process's earlier runs
  would change the keys."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

HERE = pathlib.Path(__file__).parent
OUT = pathlib.Path(os.environ.get("RNGAUDIT_RECORD_OUT", HERE / "linen_old_flax.json"))  # (the matrix's own file)
RANDOM = int(os.environ.get("RNGAUDIT_RECORD_RANDOM", "40"))  # random specs of each generator
MAX_ROWS = 150  # keys of a recorded case, at most

LEAF = "{class: Leaf, body: [{param: k}, {make_rng: dropout}]}"
HAND = [
    # the upgrade check's model: nn.jit, a stream that is not passed (falls back to params) and nn.vmap
    """
    rngs: {params: 0, dropout: 1}
    model:
      class: Model
      body:
        - Dense: {features: 4}
        - make_rng: noise
        - jit: {module: {class: Block, body: [{Dense: {features: 4}}, {Dropout: {rate: 0.1, deterministic: false}}]}}
        - vmap:
            module: {class: Leaf, body: [{param: k}, {make_rng: dropout}]}
            axis_size: 3
            variable_axes: {params: 0}
            split_rngs: {params: true, dropout: false}
    """,
    # a jitted root, nested jits, a jit in a vmap and in a scan
    f"""
    rngs: {{params: 0, dropout: 1}}
    model:
      jit:
        module:
          class: Root
          body:
            - make_rng: dropout
            - jit: {{module: {{class: Outer, body: [{{make_rng: dropout}}, {{jit: {{module: {LEAF}}}}}]}}}}
            - vmap: {{module: {{jit: {{module: {LEAF}}}}}, axis_size: 2, variable_axes: {{params: 0}},
                      split_rngs: {{params: true, dropout: true}}}}
            - scan: {{module: {{jit: {{module: {LEAF}}}}}, length: 2, variable_axes: {{params: 0}},
                      split_rngs: {{params: true, dropout: true}}}}
    """,
    # jit's rngs filter (dropout hidden: falls back to params), a Transformer-like stack of scanned,
    # rematerialised blocks under a jitted encoder, in apply
    """
    rngs: {params: 0, dropout: 1}
    phase: apply
    model:
      class: Model
      body:
        - jit: {module: {class: Head, body: [{make_rng: dropout}, param: w]}, rngs: [params]}
        - jit:
            module:
              class: Encoder
              body:
                - Embed: {num_embeddings: 8, features: 4}
                - scan:
                    module:
                      remat:
                        module:
                          class: Block
                          body:
                            - MultiHeadDotProductAttention: {num_heads: 1, dropout_rate: 0.1, deterministic: false}
                            - Dense: {features: 4}
                            - Dropout: {rate: 0.1, deterministic: false}
                    length: 3
                    variable_axes: {params: 0}
                    split_rngs: {params: true, dropout: true}
    """,
    # a jitted root over map_variables(init=True) whose module draws in setup(): up to 0.8.5 setup() runs only in
    # the traces (the first run of map_variables throws its keys away), from 0.9.0 once before them too
    """
    rngs: {params: 0}
    model:
      jit:
        module:
          map_variables:
            module: {class: Block, setup: [make_rng], body: [make_rng]}
            init: true
            mutable: true
        rngs: all
    """,
    # setup() of a jitted module, and its setup children called inside
    """
    rngs: {params: 0, dropout: 1}
    model:
      class: Model
      body:
        - jit:
            name: s
            module:
              class: S
              setup: [{module: {class: Leaf, name: inner, body: [param: k, {make_rng: dropout}]}}, {param: w}]
              body: [{make_rng: dropout}, {call: inner}]
    """,
]

# Models whose keys the probe reads off the variables: (spec body, Flax code of the same model).
PROBES = {
    "two_instances_called_twice": (
        f"""
        class: P
        setup: [{{jit: {{module: {LEAF}, name: a}}}}, {{jit: {{module: {LEAF}, name: b}}}}]
        body: [{{call: a}}, {{call: b}}, {{call: a}}, {{call: b}}]
        """,
        """
        class P(nn.Module):
            @nn.compact
            def __call__(self, x):
                a, b = JitLeaf(name='a'), JitLeaf(name='b')
                for m in (a, b, a, b):
                    x = call(self, m, x)
                return x
        """,
    ),
    "one_instance_three_calls": (
        f"""
        class: P
        setup: [{{jit: {{module: {LEAF}, name: JitLeaf_0}}}}]
        body: [{{make_rng: dropout}}, {{call: JitLeaf_0}}, {{call: JitLeaf_0}}, {{call: JitLeaf_0}}, {{make_rng: dropout}}]
        """,
        """
        class P(nn.Module):
            @nn.compact
            def __call__(self, x):
                self.sow('keys', 'd', kd(self.make_rng('dropout')))
                a = JitLeaf(name='JitLeaf_0')
                for _ in range(3):
                    x = call(self, a, x)
                self.sow('keys', 'd', kd(self.make_rng('dropout')))
                return x
        """,
    ),
    "layers_of_one_jitted_class": (
        f"""
        class: P
        body: [{{jit: {{module: {LEAF}, repeat: 3}}}}]
        """,
        """
        class P(nn.Module):
            @nn.compact
            def __call__(self, x):
                for i in range(3):
                    x = call(self, JitLeaf(name=f'JitLeaf_{i}'), x)
                return x
        """,
    ),
    "jit_in_scan": (
        f"""
        class: P
        body: [{{scan: {{module: {{jit: {{module: {LEAF}}}}}, length: 2, variable_axes: {{params: 0}},
                split_rngs: {{params: true, dropout: true}}}}}}]
        """,
        """
        class CarryLeaf(nn.Module):
            @nn.compact
            def __call__(self, c, x):
                k = self.param('k', lambda key: kd(key))
                return c, kd(self.make_rng('dropout'))

        class P(nn.Module):
            @nn.compact
            def __call__(self, x):
                S = nn.scan(nn.jit(CarryLeaf), variable_axes={'params': 0},
                            split_rngs={'params': True, 'dropout': True}, length=2)
                _, d = S(name='ScanJitLeaf_0')(x, None)
                self.sow('keys', 'ScanJitLeaf_0@d', d)
                return x
        """,
    ),
    "missing_stream": (
        """
        class: P
        body: [{make_rng: noise}, {make_rng: noise}]
        """,
        """
        class P(nn.Module):
            @nn.compact
            def __call__(self, x):
                self.sow('keys', 'n', kd(self.make_rng('noise')))
                self.sow('keys', 'n', kd(self.make_rng('noise')))
                return x
        """,
    ),
}
PROBE_HEAD = """
import json, sys
import jax, jax.numpy as jnp, flax, flax.linen as nn
import numpy as np

def kd(k):
    return jax.random.key_data(k) if jnp.issubdtype(k.dtype, jax.dtypes.prng_key) else k

class Leaf(nn.Module):  # (it returns its make_rng's key: a sow inside would change its variables at every call)
    @nn.compact
    def __call__(self, x):
        k = self.param('k', lambda key: kd(key))
        return x, kd(self.make_rng('dropout'))

JitLeaf = nn.jit(Leaf)

def call(parent, m, x):
    \"\"\"Call m; sow its key in the parent as '<m's name>@d' (the key of m's make_rng).\"\"\"
    x, d = m(x)
    parent.sow('keys', m.name + '@d', d)
    return x
"""
PROBE_TAIL = """
rngs = {'params': jax.random.PRNGKey(0), 'dropout': jax.random.PRNGKey(1)}
if sys.argv[1] == 'missing_stream':
    del rngs['dropout']
try:
    v = flax.core.unfreeze(P().init(rngs, jnp.ones((1,))))
    print(json.dumps(jax.tree_util.tree_map(lambda a: np.asarray(a).astype(np.int64).tolist(), v)))
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e).split(chr(10))[0][:200]}))
"""


def spec_text(version: str, body: str, rngs: str = "{params: 0, dropout: 1}") -> str:
    """A hand-written spec (a whole one from `rngs:` on, or a model body) under `version`'s rules, with the
    installed JAX's threefry_partitionable default."""
    head = f"rngaudit: 1\nflax: {{version: '{version}'}}\njax: {{threefry_partitionable: {str(_jax_partitionable()).lower()}}}\n"
    body = textwrap.dedent(body).strip()
    if body.startswith("rngs"):
        return head + body + "\n"
    return head + f"rngs: {rngs}\nmodel:\n" + textwrap.indent(body, "  ") + "\n"


def with_version(text: str, version: str) -> str:
    """A random spec (YAML) that names `version`."""
    import yaml

    doc = yaml.safe_load(text)
    doc.setdefault("flax", {})["version"] = version
    return yaml.safe_dump(doc, allow_unicode=True, sort_keys=False)


def _jax_partitionable() -> bool:
    import jax

    return bool(jax.config.jax_threefry_partitionable)


def probe(name: str) -> dict:
    """One probe model, run in a fresh process (jax's trace cache starts empty)."""
    code = PROBE_HEAD + textwrap.dedent(PROBES[name][1]) + PROBE_TAIL
    out = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def dump(doc: dict) -> str:
    """The recording as JSON with one case (or probe) per line: small, and a re-recording diffs by case."""
    out = ["{"]
    for i, (version, entry) in enumerate(sorted(doc.items())):
        head = {k: v for k, v in entry.items() if k not in ("cases", "probes")}
        out.append(f" {json.dumps(version)}: {{")
        out.extend(f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in sorted(head.items()))
        for j, key in enumerate(("cases", "probes")):
            items = [f"   {json.dumps(c, sort_keys=True, separators=(',', ':'))}" for c in entry[key]]
            out.append(f'  "{key}": [\n' + ",\n".join(items) + "\n  ]" + ("," if j == 0 else ""))
        out.append(" }" + ("," if i < len(doc) - 1 else ""))
    out.append("}")
    return "\n".join(out) + "\n"


def main() -> None:
    import flax
    import jax
    from flax_oracle import OracleUnsupported, flax_keys, flax_rows
    from hypothesis import HealthCheck, given, settings

    sys.path.insert(0, str(HERE.parent / "engine"))
    from test_replay_property import specs, transform_specs

    from rngaudit.spec.parse import parse_spec

    version = flax.__version__
    texts = [spec_text(version, t) for t in HAND]
    for gen in (specs(), transform_specs()):

        @settings(max_examples=RANDOM, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(gen)
        def collect(text):
            texts.append(with_version(text, version))

        collect()
    cases = []
    skipped = 0
    for text in texts:
        spec = parse_spec(text, "<recorded>")
        try:
            rows = flax_rows(flax_keys(spec, False))
            if len(rows) > MAX_ROWS:
                skipped += 1  # (a large random model adds bytes to the fixture, not rules)
                continue
            cases.append({"spec": text, "rows": [[list(r[0]), r[1], r[2], r[3], list(r[4]), list(r[5])] for r in rows]})
        except OracleUnsupported:
            skipped += 1
        except Exception as e:  # noqa: BLE001 - whatever Flax raises is what is recorded
            cases.append({"spec": text, "error": type(e).__name__, "message": str(e).split("\n")[0][:200]})
    probes = []
    for name, (body, _) in PROBES.items():
        rngs = "{params: 0}" if name == "missing_stream" else "{params: 0, dropout: 1}"
        probes.append({"name": name, "spec": spec_text(version, body, rngs), "variables": probe(name)})
    doc = json.loads(OUT.read_text()) if OUT.exists() else {}
    doc[version] = {
        "flax": version,
        "jax": jax.__version__,
        "threefry_partitionable": _jax_partitionable(),
        "cases": cases,
        "probes": probes,
    }
    OUT.write_text(dump(doc))
    print(
        f"{version}: {len(cases)} cases ({sum('error' in c for c in cases)} errors, {skipped} left out: the oracle "
        f"cannot build them or they are large), {len(probes)} probes -> {OUT}"
    )


if __name__ == "__main__":
    main()
