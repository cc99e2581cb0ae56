"""Logit parity with Hugging Face transformers' DeepseekV4ForCausalLM (float32, CPU).

The reference is required: if transformers/torch are not importable this module fails (no skip).
"""
import numpy as np
import pytest
import torch

import dsv4_jax
from dsv4_jax.model import decode
from dsv4_jax.io.convert.hf import load_hf_dir

from . import hf_reference as ref

TOL = 1e-4
CASES = [("swa_csa_hca", 2, 37), ("flash_like", 2, 70), ("wide_hca_first", 3, 53), ("two_streams_top1", 2, 41)]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def case(request, tmp_path_factory):
    name, batch, seq = request.param
    model = ref.build(name, seed=0)
    path = tmp_path_factory.mktemp(name)
    ref.save(model, path)
    ids = torch.randint(2, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    return name, model, path, ids


def test_logits_match_hf(case):
    name, model, path, ids = case
    config, params = load_hf_dir(path)
    want = ref.logits(model, ids).numpy()
    got = np.asarray(dsv4_jax.forward(params, config, ids.numpy().astype(np.int32)))
    diff = np.abs(got - want).max()
    print(f"{name}: max |logit diff| = {diff:.3e} (mean |logit| {np.abs(want).mean():.3f}, shape {want.shape})")
    assert got.dtype == np.float32
    assert 0.3 < np.abs(want).mean() < 3.0          # logits of magnitude ~1: the tolerance means something
    assert diff <= TOL


def test_indexer_selects_and_has_no_ties(case):
    """The parity test only proves the indexer if it really selects, and ties would make it ill-posed."""
    name, model, _, ids = case
    cfg = model.config
    m = cfg.compress_rates["compressed_sparse_attention"]
    assert ids.shape[1] // m > cfg.index_topk           # more compressed rows than index_topk
    assert ids.shape[1] > 3 * cfg.sliding_window
    assert ref.count_topk_boundary_ties(model, ids) == 0


def test_coverage_of_layer_types():
    seen_types, streams, hash_layers = set(), set(), 0
    for name, *_ in CASES:
        cfg = ref.build(name).config
        seen_types |= set(cfg.layer_types)
        hash_layers += cfg.mlp_layer_types.count("hash_moe")
        streams.add(cfg.hc_mult)
    assert streams == {2, 4}
    assert seen_types == {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    assert hash_layers > 0


def test_incremental_decoding_matches_hf_over_a_long_run(tmp_path):
    """Prefill 100 tokens, then 200 single-token steps: every logit row against HF's full forward.

    300 positions are 37 sliding windows, 75 CSA and 18 HCA compressed rows: the ring buffers wrap
    many times, and the yarn-scaled rotary runs past its original 16-position range.
    """
    model = ref.build("flash_like", seed=3)
    ref.save(model, tmp_path)
    ids = torch.randint(2, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(4))
    want = ref.logits(model, ids).numpy()
    config, params = load_hf_dir(tmp_path)
    tokens = ids.numpy().astype(np.int32)
    logits, state, _ = decode.prefill(params, config, tokens[:, :100], max_len=300)
    got = [np.asarray(logits)]
    for i in range(100, 300):
        step, state, _ = decode.decode_step(params, config, state, tokens[:, i])
        got.append(np.asarray(step)[:, None])
    diff = np.abs(np.concatenate(got, axis=1) - want).max()
    print(f"prefill 100 + 200 decode steps: max |logit diff| = {diff:.3e}")
    assert diff <= TOL
