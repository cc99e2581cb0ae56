"""The public entry points (issue 17): the backend choice as a static jit key resolved at the boundary,
the config bundle `load_checkpoint` returns accepted everywhere, grouped generate options, and drafters
registered by name.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as d
from dsv4_jax.model import decode as D
from dsv4_jax.backends import REFERENCE, BackendError, Backends, resolve
from dsv4_jax.bundle import CheckpointConfig, target_config, unbundle
from dsv4_jax.io.convert.cli import main as convert
from dsv4_jax.drafters import registry
from dsv4_jax.drafters.base import DraftSetup, Drafter
from dsv4_jax.model.target import forward_jit
from dsv4_jax.model.params import init_mtp
from dsv4_jax.speculative.options import RunShape, Sampling, Speculation, group_options

from . import convert_fixtures as fx

# MoE experts in float32: kernels vs references within 1e-4 of the largest value (tests/test_kernels_moe.py),
# the indexer scores within 1e-5 (tests/test_kernels_indexer.py); the logits inherit the looser one.
KERNEL_TOL = 1e-4


@pytest.fixture(scope="module")
def tiny():
    config = d.tiny()           # SWA, SWA, CSA, HCA, CSA: every hot op (routing, experts, indexer) runs
    params = d.init_params(config, 0)
    params["mtp"] = init_mtp(config, 1)
    tokens = np.random.default_rng(0).integers(2, config.vocab_size, (2, 12)).astype(np.int32)
    return config, params, tokens


def _primitives(jaxpr, acc):
    for e in jaxpr.eqns:
        acc.add(e.primitive.name)
        for p in e.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _primitives(inner, acc)
    return acc


def test_reference_and_pallas_side_by_side(tiny):
    """One process, two backends: two jit cache entries of the same forward, equal logits."""
    config, params, tokens = tiny
    n0 = forward_jit._cache_size()
    ref = np.asarray(d.forward(params, config, tokens, backends="reference"))
    pal = np.asarray(d.forward(params, config, tokens, backends="pallas"))
    assert forward_jit._cache_size() == n0 + 2
    d.forward(params, config, tokens, backends=Backends())        # equal to "reference": no new entry
    d.forward(params, config.with_backends(resolve("pallas")), tokens)   # the config's own choice: cached
    assert forward_jit._cache_size() == n0 + 2
    err = np.abs(pal - ref).max()
    print(f"pallas (interpret) vs reference logits: max |diff| {err:.2e}, max |logit| {np.abs(ref).max():.2f}")
    assert err <= KERNEL_TOL * max(1.0, np.abs(ref).max())
    # the kernels did run in the "pallas" program, and only there
    jaxpr = lambda b: jax.make_jaxpr(lambda p, t: forward_jit(p, target_config(config, b), t))(params, tokens).jaxpr
    assert "pallas_call" in _primitives(jaxpr("pallas"), set())
    assert "pallas_call" not in _primitives(jaxpr("reference"), set())


def test_auto_is_resolved_before_tracing(tiny):
    config, _, _ = tiny
    assert resolve("auto", platform="cpu") == REFERENCE
    gpu = resolve("auto", platform="gpu")
    assert (gpu.moe, gpu.routing, gpu.indexer, gpu.interpret) == ("pallas", "pallas", "pallas", False)
    assert gpu.unroll_sinkhorn and not resolve("auto", platform="cpu").unroll_sinkhorn   # static, per platform
    assert resolve("pallas", platform="cpu").interpret                 # no Triton on CPU: interpret mode
    assert target_config(config, "auto").backends == resolve("auto")
    auto = config.with_backends(Backends(moe="auto", routing="auto", indexer="auto"))
    assert target_config(auto).backends.resolved                       # the config's own "auto", resolved
    with pytest.raises(BackendError, match="reached traced code"):     # the jitted step refuses it
        jax.eval_shape(lambda p, t: forward_jit(p, auto, t), d.abstract_params(config), jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(BackendError, match="unknown kernels choice"):
        d.forward({}, config, jnp.zeros((1, 4), jnp.int32), backends="triton")


def test_entry_points_take_the_bundle(tiny):
    """A CheckpointConfig is unbundled at every entry point: the same compiled programs as its target."""
    config, params, tokens = tiny
    bundle = CheckpointConfig(config, mtp_layers=1)
    assert unbundle(bundle) == (config, {"mtp": 1})
    with pytest.raises(TypeError, match="ModelConfig or the CheckpointConfig"):
        unbundle({"hidden_size": 64})
    np.testing.assert_array_equal(np.asarray(d.forward(params, bundle, tokens)),
                                  np.asarray(d.forward(params, config, tokens)))
    _, sa, _ = D.prefill(params, config, tokens[:, :8], max_len=16, max_block=3)
    n0 = D.process_block._cache_size()
    _, sb, _ = D.prefill(params, bundle, tokens[:, :8], max_len=16, max_block=3, backends="reference")
    la, sa, _ = D.decode_step(params, config, sa, tokens[:, 8])
    lb, sb, _ = D.decode_step(params, bundle, sb, tokens[:, 8], backends="auto")   # auto = reference on CPU
    np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))
    va, _, _ = D.verify(params, config, sa, tokens[:, 9:11])
    vb, sb, _ = D.verify(params, bundle, sb, tokens[:, 9:11])        # the state is donated: use the returned one
    np.testing.assert_array_equal(np.asarray(va), np.asarray(vb))
    _, sb, _ = D.extend(params, bundle, sb, tokens[:, 9:11])
    assert int(sb.pos[0]) == 11
    assert D.process_block._cache_size() == n0 + 2        # the decode and verify shapes; prefill was cached


def test_generate_options_in_groups_or_keywords(tiny):
    config, params, tokens = tiny
    prompts = [tokens[0, :5].tolist(), tokens[1, :3].tolist()]
    grouped = d.generate(params, config, prompts, 6, sampling=Sampling(temperature=0.8, top_p=0.9, seed=3),
                         speculation=Speculation(drafter="mtp", draft_n_max=2), run=RunShape(eos_token_id=-1,
                                                                                            max_len=32))
    flat = d.generate(params, config, prompts, 6, temperature=0.8, top_p=0.9, seed=3, drafter="mtp", draft_n_max=2,
                      eos_token_id=-1, max_len=32)
    assert grouped[0] == flat[0] and grouped[1]["drafted"] == flat[1]["drafted"] > 0
    # a keyword next to its group overrides that field; unknown names are refused before any work
    sp, spec, run = group_options(speculation=Speculation("dspark", 5), draft_n_max=2, host_loop=True)
    assert (sp, spec, run) == (Sampling(), Speculation("dspark", 2), RunShape(host_loop=True))
    with pytest.raises(TypeError, match="unknown generate option"):
        d.generate(params, config, prompts, 4, temprature=0.5)
    with pytest.raises(TypeError, match="takes a Sampling"):
        d.generate(params, config, prompts, 4, sampling={"temperature": 0.5})


class RepeatLast(Drafter):
    """A test drafter: proposes the last token k times (point masses), no state, no weights."""

    name = "test-repeat-last"

    def configure(self, params, config, k, options=None, bundle=None):
        return DraftSetup(k=k)

    def propose(self, run, state, pos, last, key, knobs, greedy):
        drafts = jnp.repeat(last[:, None], run.setup.k, axis=1)
        return drafts, jax.nn.one_hot(drafts, run.config.vocab_size), jnp.full(pos.shape, run.setup.k, jnp.int32)


REPEAT_LAST = RepeatLast()      # registered by both tests below: the second's first run reuses the first's program


def test_a_registered_drafter_runs_in_the_loop(tiny):
    config, params, tokens = tiny
    prompts = [tokens[0, :4].tolist()]
    plain, _ = d.generate(params, config, prompts, 8, eos_token_id=-1)
    registry.register(REPEAT_LAST)
    try:
        assert "test-repeat-last" in registry.names()
        toks, stats = d.generate(params, config, prompts, 8, drafter="test-repeat-last", draft_n_max=2,
                                 eos_token_id=-1)
    finally:
        registry.unregister("test-repeat-last")
    assert toks == plain                                  # greedy verification keeps it lossless
    assert stats["drafter"] == "test-repeat-last" and stats["drafted"] > 0
    with pytest.raises(ValueError, match="drafter must be one of"):
        d.generate(params, config, prompts, 4, drafter="test-repeat-last")
    with pytest.raises(ValueError, match="built in"):
        registry.unregister("mtp")


class NoDrafts(RepeatLast):
    """Another drafter under RepeatLast's name: proposes nothing."""

    def propose(self, run, state, pos, last, key, knobs, greedy):
        drafts, q, _ = super().propose(run, state, pos, last, key, knobs, greedy)
        return drafts, q, jnp.zeros(pos.shape, jnp.int32)


def test_reregistering_a_drafter_changes_the_next_run(tiny):
    """The loop's jit key holds the Drafter object, not its name (docs/design.md property 1): a drafter
    registered anew under a name is a new program; the result reads as a pair or by attribute."""
    config, params, tokens = tiny
    prompts = [tokens[0, :4].tolist()]
    runs = []
    try:
        for drafter in (REPEAT_LAST, NoDrafts()):
            registry.register(drafter)
            runs.append(d.generate(params, config, prompts, 8, drafter="test-repeat-last", draft_n_max=2,
                                   eos_token_id=-1))
    finally:
        registry.unregister("test-repeat-last")
    (toks, stats), again = runs
    assert stats["drafted"] > 0 and again.stats["drafted"] == 0 and again.tokens == toks
    assert again.rounds == again.stats["rounds"] and again.mean_accepted_length == 1.0


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """An official FP8/FP4 release with an MTP block and a separate DSpark directory, through dsv4-convert."""
    tmp = tmp_path_factory.mktemp("ckpt")
    rng = np.random.default_rng(0)
    tensors, _ = fx.official_tensors(fx.state(fx.build_model(seed=0)))
    fx.official_mtp(rng, tensors)
    fx.write_official(tmp / "hf", tensors, fx.official_config())
    dsp = {}
    fx.official_dspark(rng, dsp, rank=8, stages=1, bias=True)
    fx.write_official(tmp / "dspark", dsp, fx.official_config(
        {"dspark_block_size": 3, "dspark_noise_token_id": 96, "dspark_target_layer_ids": [0, 1, 2],
         "num_nextn_predict_layers": 1}))
    assert convert(["hf", str(tmp / "hf"), str(tmp / "out"), "--dspark", str(tmp / "dspark"), "--dtype", "f32",
                    "-q"]) == 0
    return str(tmp / "out")


def test_readme_snippet_on_a_checkpoint_with_drafters(converted):
    """README: `config, params = load_checkpoint(dir)`, then forward / generate(drafter="dspark" | "mtp")."""
    config, params = d.load_checkpoint(converted)
    assert isinstance(config, CheckpointConfig) and config.mtp_layers == 1 and config.dspark.block_size == 3
    prompt = np.random.default_rng(1).integers(2, fx.V, 10).tolist()
    toks, stats = d.generate(params, config, [prompt], 6, drafter="dspark", draft_n_max=5, eos_token_id=-1)
    assert stats["drafted"] > 0
    assert stats["draft_n_max"] == 3                      # capped at the block size stored in the checkpoint
    mtp_toks, stats = d.generate(params, config, [prompt], 6, drafter="mtp", draft_n_max=2, eos_token_id=-1)
    assert stats["drafted"] > 0
    logits = d.forward(params, config, np.asarray([prompt + toks[0][:-1]], np.int32))
    assert logits.shape == (1, 15, fx.V)
    # both speculative runs are the target's own greedy continuation (teacher-forced argmax of forward)
    greedy = np.argmax(np.asarray(logits)[0, len(prompt) - 1:], axis=-1).tolist()
    assert toks[0] == greedy and mtp_toks[0] == greedy
