"""Records the keys an older Flax NNX hands out for NNX specs that say `flax: {version: <that release>}`, as
the fixture tests/data/nnx_old_flax.json that tests/engine/test_nnx_versions.py compares derive with.

Run it with the older Flax installed (a separate virtualenv), from the repository root:

    python3 -m venv /tmp/v010 && /tmp/v010/bin/pip install flax==0.10.2 jax==0.10.2 jaxlib==0.10.2 \\
        pyyaml typer rich hypothesis pytest
    PYTHONPATH=.:tests /tmp/v010/bin/python tests/data/record_old_nnx.py

It appends (or replaces) that release's entry: the hand-written specs below and 60 random ones drawn by the
NNX property test's generator (which keeps to what that release has), each with every key real NNX handed
out (step, tag, count, key data) or the error it raised."""

from __future__ import annotations

import json
import pathlib
import sys
import textwrap

HERE = pathlib.Path(__file__).parent
OUT = HERE / "nnx_old_flax.json"

HAND = [
    # the guide's model: Dropout and attention draw from the caller's dropout stream at each call
    """
    rngs: {params: 0, dropout: 1}
    run: [call, call, {reseed: {dropout: 3}}, call]
    model:
      class: Model
      init:
        - Linear: {name: linear}
        - Dropout: {name: drop, rate: 0.5}
        - MultiHeadAttention: {name: attn, dropout_rate: 0.5}
        - Dropout: {name: d2, rate: 0.5}
      call: [{call: drop}, {call: attn}, {call: d2}]
    """,
    # the default stream serves dropout: one counter for params-less draws
    """
    rngs: {default: 0, params: 1}
    steps: 2
    model: {class: M, init: [Linear, {Dropout: {name: d, rate: 0.5}}], call: [{call: d}]}
    """,
    # no dropout stream: construction works, the call fails
    """
    rngs: {params: 0}
    model: {class: M, init: [Linear, {Dropout: {name: d, rate: 0.5}}], call: [{call: d}]}
    """,
    # a stale jitted step, then the data-parallel split and a broadcast scan
    """
    rngs: {params: 0, dropout: 1}
    run: [{stale_call: 2}, {call: {vmap: 3, split: dropout}}, {call: {n: 2, scan: 3, broadcast: dropout}}, call]
    model:
      class: M
      init: [Linear, {Dropout: {name: d, rate: 0.5}}, {module: {name: sub, class: S, keep_rngs: true, call: [{draw: dropout}]}}]
      call: [{call: d}, {call: sub}]
    """,
    # model.eval() / model.train(): every Dropout and attention layer (one built deterministic too)
    """
    rngs: {params: 0, dropout: 1}
    run: [call, eval, call, train, call, {reseed: {dropout: 1}}, eval, {stale_call: 1}, train, call]
    model:
      class: M
      init:
        - Dropout: {name: d, rate: 0.5}
        - Dropout: {name: still, rate: 0.5, deterministic: true}
        - MultiHeadAttention: {name: attn, dropout_rate: 0.5}
      call: [{call: d}, {call: still}, {call: attn}]
    """,
]


def main() -> None:
    import flax
    from hypothesis import HealthCheck, given, settings
    from nnx_oracle import nnx_keys

    sys.path.insert(0, str(HERE.parent / "engine"))
    from test_nnx_property import nnx_specs

    from rngaudit.spec.parse import parse_spec

    version = flax.__version__
    texts = [f"rngaudit: 1\nflavour: nnx\nflax: {{version: '{version}'}}\n" + textwrap.dedent(t) for t in HAND]

    @settings(max_examples=60, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(nnx_specs())
    def collect(text):
        texts.append(text)

    collect()
    cases = []
    for text in texts:
        spec = parse_spec(text, "<recorded>")
        try:
            records = nnx_keys(spec)
            if any("tag" not in r for r in records):
                continue  # (a key given to a Dropout's call is seen in the mask it drops: no key to record)
            keys = [[r["step"], r["tag"], r["count"], list(r["key"])] for r in records]
            cases.append({"spec": text, "keys": keys})
        except (AttributeError, KeyError, ValueError) as e:
            cases.append({"spec": text, "error": type(e).__name__, "message": str(e).split("\n")[0][:200]})
    doc = json.loads(OUT.read_text()) if OUT.exists() else {}
    import jax

    doc[version] = {"flax": version, "jax": jax.__version__, "cases": cases}
    OUT.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"{version}: {len(cases)} cases ({sum('error' in c for c in cases)} errors) -> {OUT}")


if __name__ == "__main__":
    main()
