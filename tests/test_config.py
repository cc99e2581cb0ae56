"""ModelConfig presets, hashability, `from_hf_config` (transformers and DeepSeek-legacy forms), error
handling, the scan schedule and the parameter count (docs/model_math.md §1, §6)."""
import dataclasses

import pytest
from transformers import DeepseekV4Config

from dsv4_jax import config as C
from dsv4_jax.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ConfigError, ModelConfig, YarnScaling
from dsv4_jax.model.params import count_params
from dsv4_jax.model.schedule import Segment, locate, segments

from . import hf_reference as ref

FLASH_RATIOS, FLASH_LEGACY = ref.FLASH_RATIOS, ref.FLASH_LEGACY


def same_except_name(a: ModelConfig, b: ModelConfig):
    diff = {f.name: (getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(ModelConfig)
            if f.name != "name" and getattr(a, f.name) != getattr(b, f.name)}
    assert not diff, diff


# ---- presets --------------------------------------------------------------------------------

def test_flash_values():
    c = C.flash()
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.head_dim, c.rope_head_dim) == \
        (129280, 4096, 43, 64, 512, 64)
    assert (c.q_lora_rank, c.o_groups, c.o_lora_rank, c.sliding_window) == (1024, 8, 1024, 128)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (64, 128, 512)
    assert (c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps) == (4, 20, 1e-6)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.moe_intermediate_size) == \
        (256, 6, 1, 2048)
    assert (c.routed_scaling_factor, c.swiglu_limit, c.rope_theta, c.compress_rope_theta) == \
        (1.5, 10.0, 10000.0, 160000.0)
    assert c.yarn == YarnScaling(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0)
    assert (c.max_position_embeddings, c.rms_norm_eps, c.norm_topk_prob) == (1048576, 1e-6, True)
    assert (c.bos_token_id, c.eos_token_id, c.num_nextn_predict_layers) == (0, 1, 1)
    # layer census: SWA 0,1; CSA(4) even 2..42; HCA(128) odd 3..41; hash layers 0..2
    assert [i for i, t in enumerate(c.layer_types) if t == SLIDING] == [0, 1]
    assert [i for i, t in enumerate(c.layer_types) if t == CSA] == list(range(2, 43, 2))
    assert [i for i, t in enumerate(c.layer_types) if t == HCA] == list(range(3, 42, 2))
    assert list(c.compress_ratios) == FLASH_RATIOS
    assert [i for i, t in enumerate(c.mlp_layer_types) if t == HASH_MOE] == [0, 1, 2]
    assert c.mlp_layer_types.count(MOE) == 40 and c.num_hash_layers == 3
    assert c.nope_head_dim == 448


def test_pro_values():
    c = C.pro()
    assert (c.hidden_size, c.num_layers, c.num_heads, c.q_lora_rank, c.o_groups, c.o_lora_rank) == \
        (7168, 61, 128, 1536, 16, 1024)
    assert (c.index_topk, c.n_routed_experts, c.moe_intermediate_size, c.routed_scaling_factor) == \
        (1024, 384, 3072, 2.5)
    assert (c.vocab_size, c.head_dim, c.rope_head_dim, c.sliding_window, c.num_experts_per_tok) == \
        (129280, 512, 64, 128, 6)
    assert list(c.compress_ratios) == [128, 128] + [4, 128] * 29 + [4]
    assert c.layer_types.count(HCA) == 31 and c.layer_types.count(CSA) == 30 and SLIDING not in c.layer_types
    assert c.num_hash_layers == 3 and c.yarn == C.flash().yarn


def test_hashable_and_frozen():
    a, b = C.flash(), C.flash()
    assert a == b and hash(a) == hash(b) and a is not b
    assert {a: 1}[b] == 1
    assert a != C.pro() and C.tiny() != C.tiny_flash_like()
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.hidden_size = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.yarn.factor = 2.0
    for f in dataclasses.fields(ModelConfig):
        v = getattr(a, f.name)
        assert not isinstance(v, (list, dict, set)), f.name


def test_dict_round_trip_and_presets():
    for name in C.PRESETS:
        c = C.preset(name)
        assert C.ModelConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ConfigError, match="unknown preset"):
        C.preset("flash-9000")
    with pytest.raises(ConfigError, match="unknown ModelConfig fields"):
        C.ModelConfig.from_dict({**C.tiny().to_dict(), "n_group": 1})


# ---- from_hf_config ---------------------------------------------------------------------------

def test_from_hf_legacy_flash():
    same_except_name(C.from_hf_config(FLASH_LEGACY), C.flash())


def test_from_hf_transformers_form_flash():
    hf = DeepseekV4Config(**{k: v for k, v in FLASH_LEGACY.items() if k not in ("architectures", "model_type")})
    d = hf.to_dict()
    assert len(d["layer_types"]) == 43 and "rope_parameters" in d
    same_except_name(C.from_hf_config(d), C.flash())
    # the transformers form alone: drop every legacy key and the top-level thetas
    pure = {k: v for k, v in d.items()
            if k not in ("compress_ratios", "num_hash_layers", "rope_scaling", "qk_rope_head_dim", "rope_theta",
                         "compress_rope_theta")}
    assert "compress_ratios" not in pure and "mlp_layer_types" in pure
    same_except_name(C.from_hf_config(pure), C.flash())


@pytest.mark.parametrize("name", list(ref.CONFIGS))
def test_from_hf_transformers_form_tiny(name):
    """Our reading of each parity config equals what transformers itself made of it."""
    hf = DeepseekV4Config(**ref.CONFIGS[name])
    c = C.from_hf_config(hf.to_dict())
    rates = hf.compress_rates
    assert c.layer_types == tuple(hf.layer_types)
    assert c.compress_ratios == tuple(0 if t == SLIDING else rates[t] for t in hf.layer_types)
    assert c.mlp_layer_types == tuple(hf.mlp_layer_types)
    comp = hf.rope_parameters["compress"]
    assert c.rope_head_dim == int(hf.head_dim * hf.partial_rotary_factor)
    assert c.compress_rope_theta == comp["rope_theta"] and c.rope_theta == hf.rope_parameters["main"]["rope_theta"]
    assert (c.yarn.factor, c.yarn.original_max_position_embeddings) == \
        (comp["factor"], comp["original_max_position_embeddings"])
    for ours, theirs in [("num_heads", "num_attention_heads"), ("hidden_size", "hidden_size"),
                         ("index_topk", "index_topk"), ("sliding_window", "sliding_window"),
                         ("routed_scaling_factor", "routed_scaling_factor"), ("o_groups", "o_groups")]:
        assert getattr(c, ours) == getattr(hf, theirs)


def test_from_hf_legacy_tiny_with_compress_rates():
    """compress_ratios with only 0/4/128 plus compress_rates: transformers semantics (128 = HCA at its rate)."""
    c = C.from_hf_config(ref.CONFIGS["swa_csa_hca"])
    assert c.layer_types == (SLIDING, SLIDING, CSA, HCA, CSA)
    assert c.compress_ratios == (0, 0, 4, 8, 4)
    assert c.mlp_layer_types == (HASH_MOE, HASH_MOE, MOE, MOE, MOE)
    assert c.rope_head_dim == 8 and c.yarn.original_max_position_embeddings == 16


def test_from_hf_arbitrary_ratios():
    d = dict(FLASH_LEGACY, num_hidden_layers=6, compress_ratios=[0, 2, 8, 4, 16, 3, 0], num_hash_layers=1)
    with pytest.raises(Exception):
        DeepseekV4Config(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    c = C.from_hf_config(d)
    assert c.compress_ratios == (0, 2, 8, 4, 16, 3)            # trailing MTP entry dropped
    assert c.layer_types == (SLIDING, HCA, HCA, CSA, HCA, HCA)  # DeepSeek semantics: overlap/indexer iff ratio 4
    assert c.mlp_layer_types == (HASH_MOE,) + (MOE,) * 5


BAD = [
    ("bad layer type", lambda d: d.update(layer_types=["sliding_attention"] * 42 + ["full_attention"]),
     "layer_types"),
    ("length mismatch", lambda d: d.update(compress_ratios=FLASH_RATIOS[:40]), "entries for 43 layers"),
    ("mlp length mismatch", lambda d: d.update(mlp_layer_types=["moe"] * 42), "mlp_layer_types"),
    ("o_groups", lambda d: d.update(o_groups=7), "divisible by o_groups"),
    ("tied", lambda d: d.update(tie_word_embeddings=True), "tie_word_embeddings"),
    ("kv heads", lambda d: d.update(num_key_value_heads=8), "num_key_value_heads"),
    ("no layers", lambda d: d.pop("num_hidden_layers"), "num_hidden_layers"),
    ("no schedule", lambda d: d.pop("compress_ratios"), "neither layer_types nor compress_ratios"),
    ("no vocab", lambda d: d.pop("vocab_size"), "vocab_size"),
    ("no experts", lambda d: d.pop("n_routed_experts"), "n_routed_experts"),
    ("negative ratio", lambda d: d.update(compress_ratios=[0, -4] + FLASH_RATIOS[2:]), "compress_ratios"),
    ("scoring", lambda d: d.update(scoring_func="sigmoid"), "scoring_func"),
    ("mscale", lambda d: d.update(rope_scaling={**FLASH_LEGACY["rope_scaling"], "attention_factor": 1.2}),
     "attention_factor"),
    ("topk > experts", lambda d: d.update(num_experts_per_tok=300), "num_experts_per_tok"),
]


@pytest.mark.parametrize("mutate,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_invalid_hf_configs(mutate, match):
    d = {k: (list(v) if isinstance(v, list) else v) for k, v in FLASH_LEGACY.items()}
    mutate(d)
    with pytest.raises(ConfigError, match=match):
        C.from_hf_config(d)


def test_invalid_model_configs():
    c = C.tiny()
    with pytest.raises(ConfigError, match="len"):
        c.replace(compress_ratios=c.compress_ratios[:-1])
    with pytest.raises(ConfigError, match="layer 2"):
        c.replace(compress_ratios=(0, 0, 0, 8, 4))
    with pytest.raises(ConfigError, match="o_groups"):
        c.replace(o_groups=3)
    with pytest.raises(ConfigError, match="rope_head_dim"):
        c.replace(rope_head_dim=7)
    with pytest.raises(ConfigError, match="layer_types"):
        c.replace(layer_types=("dense",) + c.layer_types[1:])
    with pytest.raises(ConfigError, match="hidden_size"):
        c.replace(hidden_size=0)
    assert issubclass(ConfigError, ValueError)


def test_load_hf_config_file(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps(FLASH_LEGACY))
    same_except_name(C.load_hf_config(tmp_path), C.flash())
    with pytest.raises(ConfigError, match="no config.json"):
        C.load_hf_config(tmp_path / "nowhere")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        C.load_hf_config(tmp_path / "bad.json")


# ---- schedule ---------------------------------------------------------------------------------

def check_partition(c: ModelConfig):
    """Segments tile the layers in order, and every repetition has the kinds of the first."""
    segs = segments(c)
    assert segs[0].start == 0 and segs[-1].stop == c.num_layers
    for a, b in zip(segs, segs[1:]):
        assert a.stop == b.start
    for s, seg in enumerate(segs):
        for rep in range(seg.reps):
            for j in range(seg.pattern):
                layer = seg.layer_index(j, rep)
                assert c.layer_kind(layer) == c.layer_kind(seg.layer_index(j, 0))
                assert locate(c, layer) == (s, j, rep)
    return segs


def test_flash_segments():
    segs = check_partition(C.flash())
    assert segs == (Segment(0, 1, 2), Segment(2, 1, 1), Segment(3, 2, 20))
    assert [C.flash().layer_types[i] for i in (3, 4)] == [HCA, CSA]
    assert check_partition(C.pro()) == (Segment(0, 1, 2), Segment(2, 1, 1), Segment(3, 2, 29))


def _cfg(ratios, n_hash):
    return C._tiny_base(name="t", ratios=list(ratios), n_hash=n_hash)


@pytest.mark.parametrize("ratios,n_hash,want", [
    ([0, 0, 4, 8, 4], 2, [(0, 1, 2), (2, 1, 1), (3, 1, 1), (4, 1, 1)]),            # tiny: nothing repeats after 0,1
    ([0, 0, 4] + [8, 4] * 3, 3, [(0, 1, 2), (2, 1, 1), (3, 2, 3)]),                 # tiny_flash_like
    ([4, 8, 4, 8, 0, 4, 8, 4, 8, 4], 0, [(0, 2, 2), (4, 1, 1), (5, 2, 2), (9, 1, 1)]),
    ([8, 0, 0, 8, 0, 0, 8, 0, 0], 1, [(0, 1, 1), (1, 3, 2), (7, 1, 2)]),              # greedy: longest cover
    ([0, 0, 0, 0, 4, 4], 6, [(0, 1, 4), (4, 1, 2)]),
])
def test_irregular_segments(ratios, n_hash, want):
    c = _cfg(ratios, n_hash)
    segs = check_partition(c)
    assert [(s.start, s.pattern, s.reps) for s in segs] == want


def test_random_schedules_partition():
    import random
    r = random.Random(0)
    for _ in range(50):
        n = r.randint(1, 14)
        c = _cfg([r.choice([0, 4, 8]) for _ in range(n)], r.randint(0, n))
        check_partition(c)
    with pytest.raises(IndexError):
        locate(C.tiny(), 5)


# ---- sizes ------------------------------------------------------------------------------------

def test_count_params_flash_and_pro():
    assert abs(count_params(C.flash()) - 284.33e9) < 0.01e9        # docs/model_math.md §6 (excluding MTP)
    assert abs(count_params(C.pro()) - 1573.0e9) < 0.1e9
