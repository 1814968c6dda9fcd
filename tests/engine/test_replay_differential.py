"""rngaudit against real Flax, one construct at a time: same keys, same values, same errors."""

from __future__ import annotations

import textwrap

import flax.linen as nn
import jax
import pytest
from flax_oracle import capture, check_against_flax, flax_keys, flax_settings

from rngaudit import derive, parse_spec


def spec_of(text: str):
    return parse_spec(textwrap.dedent(text))


def agree(text: str, raw_keys: bool = False):
    return check_against_flax(spec_of(text), raw_keys=raw_keys)


def keys_by_path(text: str) -> dict:
    """Flax's keys grouped by (path, stream used), in order: for checks of structure, not of values."""
    out: dict = {}
    for r in flax_keys(spec_of(text)):
        out.setdefault((r["path"], r["stream"]), []).append(r["key"])
    return out


# ---------------------------------------------------------------- R1, R2: the basic formula, counters
def test_root_and_submodules():
    a = agree("""
        rngaudit: 1
        rngs: {params: 0}
        model:
          class: Model
          body:
            - make_rng: {stream: params, repeat: 3}
            - module:
                class: RNGSubModule
                body:
                  - make_rng
                  - module: {class: RNGSubSubModule, body: [make_rng]}
        """)
    assert a.keys == 5


def test_counts_per_scope_and_stream():
    a = agree("""
        rngaudit: 1
        rngs: {params: 0, dropout: 1, noise: 2}
        model:
          class: Model
          body:
            - make_rng: dropout
            - make_rng: noise
            - module: {class: Sub, name: s, body: [{make_rng: dropout}, {make_rng: noise}, {make_rng: dropout}]}
            - make_rng: dropout
            - make_rng: params
            - call: s
            - make_rng: noise
        """)
    assert a.keys == 11


def test_streams_with_the_same_seed_give_the_same_keys():
    text = """
        rngaudit: 1
        rngs: {params: 7, dropout: 7, noise: "key(7)"}
        model:
          class: Model
          body:
            - make_rng: params
            - make_rng: dropout
            - make_rng: noise
        """
    assert agree(text).keys == 3
    by = keys_by_path(text)
    assert by[((), "params")] == by[((), "dropout")] == by[((), "noise")]


# ---------------------------------------------------------------- R3, R4: fallback and InvalidRngError
def test_fallback_to_params_shares_the_params_counter():
    text = """
        rngaudit: 1
        rngs: {params: 0}
        model:
          class: Model
          body:
            - make_rng: params
            - make_rng: noise
            - make_rng: params
            - module: {class: Sub, body: [{make_rng: dropout}, param: w, {make_rng: dropout}]}
        """
    a = agree(text)
    assert a.fallbacks == 3
    assert len(keys_by_path(text)[((), "params")]) == 3


@pytest.mark.parametrize(
    "rngs,body",
    [
        ("{params: 0}", "[{make_rng: noise}]"),  # falls back: no error
        ("{dropout: 0}", "[{make_rng: noise}]"),  # root: 'None needs PRNG'
        ("{dropout: 0}", "[{module: {class: Sub, name: sub, body: [{make_rng: noise}]}}]"),
        ("{}", "[{Dense: {features: 2}}]"),  # init without a params key
        ("{noise: 1}", "[{make_rng: noise}, {param: w}]"),
        ("{noise: 1}", "[{module: {class: Sub, name: '', body: [{make_rng: x}]}}]"),
    ],
)
def test_invalid_rng_error_when_neither_stream_nor_params(rngs, body):
    a = agree(f"""
        rngaudit: 1
        rngs: {rngs}
        model: {{class: Model, body: {body}}}
        """)
    assert a.error in (None, "InvalidRngError")
    assert (a.error is None) == ("params" in rngs)


# ---------------------------------------------------------------- R5: naming
def test_autonaming_cursor_per_class_and_per_parent():
    text = """
        rngaudit: 1
        rngs: {params: 0}
        model:
          class: Model
          body:
            - module: {class: A, body: [make_rng, {module: {class: A, body: [make_rng]}}]}
            - module: {class: B, body: [make_rng]}
            - module: {class: A, body: [make_rng, {module: {class: B, body: [make_rng]}}]}
        """
    agree(text)
    assert {p for p, _ in keys_by_path(text)} == {("A_0",), ("A_0", "A_0"), ("B_0",), ("A_1",), ("A_1", "B_0")}


def test_explicit_names_do_not_advance_the_cursor():
    text = """
        rngaudit: 1
        rngs: {params: 0}
        model:
          class: Model
          body:
            - module: {class: A, name: first, body: [make_rng]}
            - module: {class: A, body: [make_rng]}
            - module: {class: A, name: A_5, body: [make_rng]}
            - module: {class: A, body: [make_rng]}
        """
    agree(text)
    assert [p for p, _ in keys_by_path(text)] == [("first",), ("A_0",), ("A_5",), ("A_1",)]


@pytest.mark.parametrize(
    "body",
    [
        "[{module: {class: NP, name: NP_0}}, {module: {class: NP}}]",  # explicit, then auto
        "[{module: {class: A, name: x}}, {module: {class: B, name: x}}]",  # duplicate explicit
        "[{param: w}, {module: {class: A, name: w}}]",  # param, then submodule
        "[{module: {class: A, name: w}}, {param: w}]",  # submodule, then param
        "[{param: w}, {param: w}]",
        "[{variable: {collection: state, name: w}}, {module: {class: A, name: w}}]",
        "[{make_rng: params}, {Dense: {features: 2}}, {Dense: {name: Dense_0}}]",
    ],
)
def test_name_clash_raises_name_in_use_error(body):
    a = agree(f"""
        rngaudit: 1
        rngs: {{params: 0}}
        model: {{class: Model, body: {body}}}
        """)
    assert a.error == "NameInUseError"


def test_param_and_variable_may_share_a_name_in_different_collections():
    a = agree("""
        rngaudit: 1
        rngs: {params: 0, noise: 1}
        model:
          class: Model
          body:
            - param: w
            - variable: {collection: state, name: w, make_rng: noise}
            - variable: {collection: cache, name: w, make_rng: [params, noise]}
        """)
    assert a.error is None and a.keys == 4


# ---------------------------------------------------------------- setup()
def test_setup_attributes_and_keys_before_call():
    a = agree("""
        rngaudit: 1
        rngs: {params: 0, dropout: 1}
        model:
          class: Model
          setup:
            - make_rng: dropout
            - param: w
            - module: {class: Enc, name: enc, setup: [make_rng], body: [{make_rng: dropout}, param: b]}
            - Dense: {name: proj, features: 3}
            - variable: {collection: state, name: v, make_rng: dropout}
            - module: {class: Unused, name: unused, setup: [make_rng], body: [make_rng]}
          body:
            - make_rng: dropout
            - call: enc
            - call: proj
            - call: enc
            - module: {class: Enc, body: [make_rng]}
        """)
    assert a.keys == 11


def test_setup_list_and_dict_attribute_names_match_flax():
    """self.lst = [A(), A()] and self.dct = {...} in real Flax; the spec names them lst_0, dct_y_1."""

    class Leaf(nn.Module):
        @nn.compact
        def __call__(self):
            return self.make_rng("params")

    class Holder(nn.Module):
        def setup(self):
            self.lst = [Leaf(), Leaf()]
            self.dct = {"y": [Leaf(), Leaf()], "x": Leaf()}

        def __call__(self):
            return [m() for m in self.lst] + [self.dct["x"](), self.dct["y"][1]()]

    spec = spec_of("""
        rngaudit: 1
        rngs: {params: 3}
        model:
          class: Holder
          setup:
            - module: {class: Leaf, name: lst_0, body: [make_rng]}
            - module: {class: Leaf, name: lst_1, body: [make_rng]}
            - module: {class: Leaf, name: dct_x, body: [make_rng]}
            - module: {class: Leaf, name: dct_y_0, body: [make_rng]}
            - module: {class: Leaf, name: dct_y_1, body: [make_rng]}
          body: [{call: lst_0}, {call: lst_1}, {call: dct_x}, {call: dct_y_1}]
        """)
    with flax_settings(spec), capture() as records:
        Holder().init(jax.random.key(3))
    theirs = [(r["path"], r["key"]) for r in records]
    ours = [(c.derivation.path, c.key) for c in derive(spec).calls]
    assert ours == theirs
    assert [p for p, _ in theirs] == [("lst_0",), ("lst_1",), ("dct_x",), ("dct_y_1",)]
    check_against_flax(spec)


def test_setup_name_clash_with_compact_child():
    a = agree("""
        rngaudit: 1
        rngs: {params: 0}
        model:
          class: Model
          setup: [{module: {class: A, name: A_0}}]
          body: [{module: {class: A}}]
        """)
    assert a.error == "NameInUseError"


# ---------------------------------------------------------------- nn.Sequential
def test_sequential_in_compact_names_layers_in_the_parent():
    text = """
        rngaudit: 1
        rngs: {params: 0, dropout: 1}
        model:
          class: Model
          body:
            - Dense: {features: 4}
            - Sequential:
                layers:
                  - Dense: {features: 4}
                  - Dropout: {rate: 0.5, deterministic: false}
                  - module: {class: Blk, body: [{make_rng: dropout}]}
                  - Dense: {features: 4, use_bias: false}
            - call: Sequential_0
            - call: Blk_0
        """
    a = agree(text)
    assert a.keys == 2 + 5 + 2 + 1
    assert ("Sequential_0",) not in {p for p, _ in keys_by_path(text)}


def test_sequential_in_setup_names_layers_under_it():
    text = """
        rngaudit: 1
        rngs: {params: 0, dropout: 1}
        model:
          class: Model
          setup:
            - Sequential:
                name: seq
                layers:
                  - Dense: {features: 4}
                  - module: {class: Blk, setup: [make_rng], body: [{make_rng: dropout}]}
                  - LayerNorm: {}
          body:
            - call: seq
            - call: {name: seq, repeat: 2}
        """
    agree(text)
    assert {p for p, _ in keys_by_path(text)} == {("seq", "layers_0"), ("seq", "layers_1"), ("seq", "layers_2")}


# ---------------------------------------------------------------- repeated calls
def test_child_called_twice_continues_counters_and_keeps_params():
    a = agree("""
        rngaudit: 1
        rngs: {params: 0, dropout: 1}
        model:
          class: Model
          body:
            - module:
                class: Block
                name: blk
                body: [{make_rng: dropout}, param: w, {module: {class: Leaf, body: [make_rng, param: v]}}]
            - call: {name: blk, repeat: 2}
            - Dense: {name: d, features: 2}
            - call: d
        """)
    # blk: 3 x (dropout + Leaf make_rng) + w + v once; d: kernel and bias once
    assert a.keys == 3 * 2 + 2 + 2


def test_compact_module_called_twice():
    a = agree("""
        rngaudit: 1
        rngs: {params: 0, noise: 1}
        model:
          class: Model
          body:
            - module:
                class: Outer
                body:
                  - make_rng: noise
                  - module: {class: Inner, setup: [{make_rng: noise}], body: [{make_rng: noise}, param: w]}
                  - module: {class: Inner, body: [{make_rng: noise}]}
                  - Dense: {features: 2}
            - call: {name: Outer_0, repeat: 2}
        """)
    # each call of Outer: a new Inner_0 (its setup runs again) and Inner_1; w and Dense_0 made once
    assert a.keys == 3 * 4 + 1 + 2


# ---------------------------------------------------------------- R7: self.param in init and apply
@pytest.mark.parametrize(
    "phase,mutable", [("init", None), ("apply", None), ("apply", "[params]"), ("apply", "true"), ("apply", "[state]")]
)
def test_param_in_init_and_apply(phase, mutable):
    a = agree(f"""
        rngaudit: 1
        phase: {phase}
        {"" if mutable is None else "mutable: " + mutable}
        rngs: {{params: 0, dropout: 1}}
        model:
          class: Model
          body:
            - param: w
            - make_rng: params
            - Dense: {{features: 3}}
            - param: {{name: late, when: apply}}
            - module: {{class: Sub, body: [{{param: {{name: only_in_apply, when: apply}}}}, make_rng]}}
        """)
    if phase == "init":
        assert a.keys == 5
    elif mutable in ("[params]", "true"):
        assert a.keys == 4  # make_rng x2, plus the two params init never made
    else:
        assert a.error == "ScopeParamNotFoundError"


@pytest.mark.parametrize(
    "body,error",
    [
        ("[{param: {name: w, when: apply}}]", "ScopeCollectionNotFound"),  # init makes no params at all
        ("[{variable: {collection: state, name: v, when: apply}}]", "ScopeCollectionNotFound"),
        (
            "[{variable: {collection: state, name: v}}, {variable: {collection: state, name: u, when: apply}}]",
            "ScopeVariableNotFoundError",
        ),
        ("[{BatchNorm: {when: apply}}]", "ScopeCollectionNotFound"),  # batch_stats come before params
        ("[{Dense: {features: 2}}, {BatchNorm: {when: apply}}]", "ScopeCollectionNotFound"),
    ],
)
@pytest.mark.parametrize("mutable", ["false", "[params]"])
def test_missing_variables_in_apply(body, error, mutable):
    a = agree(f"""
        rngaudit: 1
        phase: apply
        mutable: {mutable}
        rngs: {{params: 0}}
        model: {{class: Model, body: {body}}}
        """)
    assert a.error == (None if mutable == "[params]" and "param:" in body else error)


@pytest.mark.parametrize("mutable", ["false", "[params]", "true"])
def test_param_named_like_a_child_finds_the_child_subtree_in_apply(mutable):
    """In apply, self.param('enc') finds the params a child named 'enc' made in init: no key."""
    a = agree(f"""
        rngaudit: 1
        phase: apply
        mutable: {mutable}
        rngs: {{params: 0}}
        model:
          class: M
          body:
            - module:
                class: Sub
                name: enc
                when: init
                body: [param: w, {{variable: {{collection: state, name: s}}}}, {{Dense: {{name: d}}}}]
            - param: {{name: enc, when: apply}}
            - variable: {{collection: state, name: enc, make_rng: params, when: apply}}
            - make_rng
        """)
    assert a.error is None and a.keys == 1


@pytest.mark.parametrize("mutable", ["false", "true"])
@pytest.mark.parametrize(
    "child",
    [
        "{Dense: {name: b, when: apply}}",
        "{module: {class: S, name: b, when: apply, body: [make_rng, param: w]}}",
        "{module: {class: S, name: b, when: apply, body: [make_rng]}}",
    ],
)
def test_module_named_like_a_variable_init_made(mutable, child):
    """In apply, a child whose name is a variable of init reads that array as its collection."""
    a = agree(f"""
        rngaudit: 1
        phase: apply
        mutable: {mutable}
        rngs: {{params: 0}}
        model:
          class: M
          body: [{{param: {{name: b, when: init}}}}, {child}]
        """)
    assert a.error == (None if "param" not in child and "Dense" not in child else "TypeError")


# ---------------------------------------------------------------- R8: self.variable
@pytest.mark.parametrize("phase,mutable", [("init", None), ("apply", "false"), ("apply", "[state]")])
def test_variable_rng_in_init_fn_vs_eager(phase, mutable):
    a = agree(f"""
        rngaudit: 1
        phase: {phase}
        {"" if mutable is None else "mutable: " + mutable}
        rngs: {{params: 0, other: 1}}
        model:
          class: Model
          body:
            - variable: {{collection: state, name: lazy, make_rng: [other, params]}}
            - variable: {{collection: state, name: eager, make_rng: other, eager: true}}
            - variable: {{collection: state, name: late, make_rng: other, when: apply}}
            - variable: {{collection: stats, name: eager2, make_rng: [missing, other], eager: true}}
            - make_rng: other
        """)
    expected = {None: 2 + 1 + 2 + 1, "false": None, "[state]": 1 + 1 + 2 + 1}[mutable]
    if expected is None:
        assert a.error == "ScopeVariableNotFoundError"
    else:
        assert a.keys == expected


# ---------------------------------------------------------------- R9: standard layers
LAYER_CASES = [
    "Dense: {}",
    "Dense: {use_bias: false}",
    "DenseGeneral: {}",
    "DenseGeneral: {use_bias: false}",
    "Einsum: {}",
    "Einsum: {use_bias: false}",
    "Conv: {}",
    "Conv: {use_bias: false}",
    "ConvTranspose: {}",
    "ConvTranspose: {use_bias: false}",
    "ConvLocal: {}",
    "ConvLocal: {use_bias: false}",
    "Embed: {}",
    "LayerNorm: {}",
    "LayerNorm: {use_scale: false}",
    "LayerNorm: {use_bias: false}",
    "LayerNorm: {use_scale: false, use_bias: false}",
    "RMSNorm: {}",
    "RMSNorm: {use_scale: false}",
    "BatchNorm: {}",
    "BatchNorm: {use_scale: false}",
    "BatchNorm: {use_bias: false}",
    "GroupNorm: {}",
    "GroupNorm: {use_scale: false}",
    "InstanceNorm: {}",
    "InstanceNorm: {use_bias: false}",
    "Dropout: {rate: 0.0, deterministic: false}",
    "Dropout: {rate: 0.5, deterministic: false}",
    "Dropout: {rate: 1.0, deterministic: false}",
    "Dropout: {rate: 0.5, deterministic: true}",
    "Dropout: {rate: 0.5, deterministic: false, rng: true}",
    "Dropout: {rate: 0.5, deterministic: false, rng_collection: noise}",
    "Dropout: {rate: 0.5, deterministic: false, rng_collection: absent}",
]
_ATTN_OPTS = [
    "{}",
    "{use_bias: false}",
    "{normalize_qk: true}",
    "{dropout_rate: 0.1, deterministic: false}",
    "{dropout_rate: 0.1, deterministic: true}",
    "{dropout_rate: 0.1, deterministic: false, dropout_rng: true}",
    "{dropout_rate: 0.5, deterministic: false, normalize_qk: true, use_bias: false}",
]
LAYER_CASES += [
    f"{cls}: {o}" for cls in ("MultiHeadDotProductAttention", "MultiHeadAttention", "SelfAttention") for o in _ATTN_OPTS
]


@pytest.mark.parametrize("layer", LAYER_CASES)
@pytest.mark.parametrize(
    "phase,rngs",
    [
        ("init", "{params: 0}"),
        ("init", "{params: 0, dropout: 1, noise: 2}"),
        ("apply", "{params: 0, dropout: 1, noise: 2}"),
    ],
)
def test_standard_layer(layer, phase, rngs):
    text = f"""
        rngaudit: 1
        phase: {phase}
        rngs: {rngs}
        model:
          class: Model
          body:
            - make_rng: dropout
            - {layer}
            - {layer}
            - make_rng: dropout
        """
    a = agree(text)
    assert a.error is None and a.keys >= 2
    names = {p[0] for p, _ in keys_by_path(text) if p}
    cls = layer.split(":")[0]
    assert names <= {f"{cls}_0", f"{cls}_1"}


# ---------------------------------------------------------------- R6, R18-R20: hashing, impls, key types
@pytest.mark.parametrize("fix", [False, True])
def test_fix_rng_separator(fix):
    text = f"""
        rngaudit: 1
        flax: {{fix_rng_separator: {str(fix).lower()}}}
        rngs: {{params: 0}}
        model:
          class: Model
          body:
            - make_rng: {{repeat: 2}}
            - module: {{class: A, name: ab, body: [{{module: {{class: B, name: cdef, body: [make_rng]}}}}]}}
            - module: {{class: A, name: abc, body: [{{module: {{class: B, name: def, body: [make_rng]}}}}]}}
        """
    assert agree(text).keys == 4
    by = keys_by_path(text)
    collide = by[(("ab", "cdef"), "params")] == by[(("abc", "def"), "params")]
    assert collide != fix


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
@pytest.mark.parametrize("partitionable", [True, False])
def test_prng_impls_and_threefry_partitionable(impl, partitionable):
    width = 2 if impl == "threefry2x32" else 4
    raw = list(range(11, 11 + width))
    a = agree(f"""
        rngaudit: 1
        jax: {{prng_impl: {impl}, threefry_partitionable: {str(partitionable).lower()}}}
        rngs:
          params: 5
          dropout: "split(key(1), 5)[3]"
          noise: "fold_in(split(key(2))[1], 4294967295)"
          raw: {raw}
        model:
          class: Model
          body:
            - make_rng: {{stream: params, draw: {{normal: [3]}}}}
            - make_rng: {{stream: dropout, draw: {{uniform: [2]}}}}
            - make_rng: noise
            - make_rng: raw
            - Dense: {{features: 2, draw: {{kernel: {{lecun_normal: [4, 2]}}}}}}
            - Dropout: {{rate: 0.5, deterministic: false}}
            - module: {{class: Sub, body: [{{make_rng: {{stream: raw, repeat: 2}}}}]}}
        """)
    assert a.keys == 9 and a.values == 3


@pytest.mark.parametrize("raw_keys", [False, True])
@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_and_raw_keys_give_the_same_key_data(raw_keys, impl):
    text = f"""
        rngaudit: 1
        jax: {{prng_impl: {impl}}}
        rngs:
          params: "jax.random.PRNGKey(42)"
          dropout: "random.split(fold_in(key(-1), 3), 4)[-1]"
          noise: {4294967301 if impl == "rbg" else 9223372036854775807}
        model:
          class: Model
          body: [make_rng, {{make_rng: dropout}}, {{make_rng: noise}}, {{Dense: {{features: 2}}}}]
        """
    assert agree(text, raw_keys=raw_keys).keys == 5


@pytest.mark.parametrize(
    "expr",
    [
        "0",
        "-7",
        "4294967296",
        "'key(3)'",
        "'split(key(3), 7)[6]'",
        "'fold_in(key(3), 0)'",
        "'fold_in(fold_in(key(0), 1), 2)'",
        "'split(split(key(9), 3)[0], 2)[1]'",
        "[0, 42]",
        "'[1, 2]'",
        "'split([1, 2], 3)[2]'",
        "'jr.fold_in(jr.PRNGKey(5), 0x10)'",
    ],
)
@pytest.mark.parametrize("partitionable", [True, False])
def test_key_expressions(expr, partitionable):
    assert (
        agree(f"""
        rngaudit: 1
        jax: {{threefry_partitionable: {str(partitionable).lower()}}}
        rngs: {{params: {expr}}}
        model: {{class: M, body: [make_rng, {{module: {{class: S, body: [make_rng]}}}}]}}
        """).keys
        == 2
    )


# ---------------------------------------------------------------- names and counts
def test_unicode_empty_digit_and_underscore_names():
    text = """
        rngaudit: 1
        rngs: {params: 0, "ß": 1, "": 2, "0": 3}
        model:
          class: Mödel
          body:
            - module: {class: Ünï, body: [{make_rng: "ß"}]}
            - module: {class: Ünï, name: "", body: [{make_rng: ""}, {param: ""}]}
            - module: {class: "_", body: [{make_rng: "0"}]}
            - module: {class: "9", name: "9", body: [make_rng, {module: {class: "9", body: [make_rng]}}]}
            - module: {class: B, name: "__", body: [{module: {class: "", body: [make_rng]}}]}
            - module: {class: B, name: "a b/c", body: [{make_rng: "ß"}]}
            - module: {class: B, name: "漢字_1", body: [{make_rng: missing}]}
        """
    assert agree(text).keys == 9
    paths = {p for p, _ in keys_by_path(text)}
    assert {("Ünï_0",), ("",), ("__0",), ("9", "9_0"), ("__", "_0"), ("a b/c",), ("漢字_1",)} <= paths


def test_counts_of_256_and_more():
    text = """
        rngaudit: 1
        rngs: {params: 0}
        model:
          class: M
          body:
            - make_rng: {repeat: 300}
            - module: {class: X, name: x, body: [{make_rng: {repeat: 257}}]}
            - module: {class: X, name: "x\\x01", body: [make_rng]}
        """
    assert agree(text).keys == 558
    by = keys_by_path(text)
    # ('x', 257) and ('x\\x01', 1) hash the same bytes: Flax hands out the same key (R6)
    assert by[(("x",), "params")][256] == by[(("x\x01",), "params")][0]


# ---------------------------------------------------------------- drawn values
@pytest.mark.parametrize("impl,partitionable", [("threefry2x32", True), ("threefry2x32", False), ("rbg", True)])
def test_drawn_values_equal_flax_initializers(impl, partitionable):
    a = agree(f"""
        rngaudit: 1
        jax: {{prng_impl: {impl}, threefry_partitionable: {str(partitionable).lower()}}}
        rngs: {{params: 0, dropout: 1}}
        model:
          class: M
          body:
            - Dense: {{features: 3, draw: {{kernel: {{lecun_normal: [5, 3]}}}}}}
            - Dense: {{features: 3, draw: {{kernel: {{normal: [2, 3]}}, bias: {{uniform: [3]}}}}}}
            - Conv: {{draw: {{kernel: {{lecun_normal: [3, 2, 4]}}}}}}
            - Embed: {{draw: {{embedding: {{variance_scaling: {{shape: [6, 4], scale: 1.0, mode: fan_in,
                                                                distribution: normal, out_axis: 0}}}}}}}}
            - LayerNorm: {{draw: {{scale: {{normal: [4]}}, bias: {{truncated_normal: [4]}}}}}}
            - Dropout: {{rate: 0.25, deterministic: false, draw: {{mask: {{bernoulli: {{shape: [2, 3], p: 0.75}}}}}}}}
            - param: {{name: w, draw: {{glorot_uniform: [3, 4]}}}}
            - param: {{name: i, draw: {{randint: {{shape: [5], minval: 0, maxval: 9, dtype: int8}}}}}}
            - param: {{name: h, draw: {{he_normal: {{shape: [4, 2], dtype: bfloat16}}}}}}
            - make_rng: {{stream: dropout, draw: {{bernoulli: {{shape: [4], p: 0.3}}}}}}
            - variable: {{collection: state, name: v, make_rng: dropout, draw: {{normal: [2]}}}}
            - variable: {{collection: state, name: e, make_rng: params, eager: true, draw: {{uniform: [2]}}}}
        """)
    assert a.values == 14
