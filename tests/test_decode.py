"""Incremental decoding over the position-indexed decode state equals the full-sequence forward."""
import jax
import numpy as np
import pytest

import dsv4_jax as d
from dsv4_jax.model import decode as D
import dsv4_jax.model.target  # noqa: F401  (d.model.target below)
from dsv4_jax.model.state import state_bytes
from dsv4_jax.config import CSA, HCA, SLIDING, tiny_flash_like

TOL = 1e-4


def _setup(config, seed=0, batch=2, length=64):
    params = d.init_params(config, jax.random.PRNGKey(seed))
    tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(seed + 1), (batch, length), 0, config.vocab_size))
    return params, tokens, np.asarray(d.forward(params, config, tokens))


@pytest.fixture(scope="module", params=["tiny", "tiny_flash_like"])
def model(request):
    config = d.tiny() if request.param == "tiny" else tiny_flash_like()
    assert {SLIDING, CSA, HCA} <= set(config.layer_types)
    return config, *_setup(config)


def test_prefill_then_decode_equals_forward(model):
    config, params, tokens, full = model
    # N = 13 starts mid-window; decoding 30 tokens crosses CSA (4) and HCA (8) windows, past W = 6
    N, M = 13, 30
    logits, state, _ = D.prefill(params, config, tokens[:, :N], max_len=64)
    got = [np.asarray(logits)]
    for i in range(M):
        lg, state, _ = D.decode_step(params, config, state, tokens[:, N + i])
        got.append(np.asarray(lg)[:, None])
    diff = np.abs(np.concatenate(got, 1) - full[:, :N + M]).max()
    print(f"{config.name}: prefill+decode max diff {diff:.2e}")
    assert diff <= TOL
    assert np.asarray(state.pos).tolist() == [N + M] * 2


def test_chunked_prefill_any_chunks(model):
    config, params, tokens, full = model
    state = None
    got, start = [], 0
    # chunk lengths are block widths the other tests of this module compile anyway (prefill 13 and 16, verify
    # 2 / 5 / 8, decode 1), so no extend program is compiled for this test alone; the boundaries
    # (2, 3, 5, 10, 23, 39, 47, 52) still fall at every offset in the CSA (4) windows, at 5 of the 8 in the
    # HCA (8) ones and anywhere in the sliding window (6), and chunks of 13 and 16 span several windows
    for c in [2, 1, 2, 5, 13, 16, 8, 5]:
        piece = tokens[:, start:start + c]
        if state is None:
            lg, state, _ = D.prefill(params, config, piece, max_len=64)
        else:
            lg, state, _ = D.extend(params, config, state, piece)
        got.append(np.asarray(lg))
        start += c
    assert np.abs(np.concatenate(got, 1) - full[:, :start]).max() <= TOL


@pytest.mark.parametrize("k", [1, 4, 7])
def test_verify_commit_every_accept_length(model, k):
    """verify k+1 tokens, commit a, continue == the accepted tokens one at a time (forward)."""
    config, params, tokens, full = model
    rng = np.random.default_rng(k)
    # block starts: on a CSA/HCA window boundary (16), just before one (15), mid-window (13)
    for start in (16, 15, 13):  # (padded prefill: tokens past `start` are ignored)
        for a in range(k + 1):
            # one padded prefill shape for every start (lengths = start): one compilation
            _, state, _ = D.prefill(params, config, tokens[:, :16], [start] * 2, max_len=64, max_block=8)
            block = tokens[:, start:start + k + 1].copy()
            # drafts after the accepted ones are wrong tokens (rows written, then rejected)
            block[:, a + 1:] = rng.integers(0, config.vocab_size, block[:, a + 1:].shape)
            vlog, state, _ = D.verify(params, config, state, block)
            assert np.abs(np.asarray(vlog)[:, :a + 1] - full[:, start:start + a + 1]).max() <= TOL
            state = D.commit(state, np.full((2,), a))
            nxt = start + a + 1
            for i in range(3):        # continue past the rejected rows; crosses the next windows
                lg, state, _ = D.decode_step(params, config, state, tokens[:, nxt + i])
                diff = np.abs(np.asarray(lg) - full[:, nxt + i]).max()
                assert diff <= TOL, (start, k, a, i, diff)
            # and a second verify block right after, to reuse rings clobbered by the rejected drafts
            vlog, state, _ = D.verify(params, config, state, tokens[:, nxt + 3:nxt + 3 + k + 1])
            assert np.abs(np.asarray(vlog) - full[:, nxt + 3:nxt + 4 + k]).max() <= TOL


def test_ragged_batch_matches_single_sequences():
    """3 sequences, different prompt lengths and per-step accepted lengths == single-sequence runs."""
    config = tiny_flash_like()
    params = d.init_params(config, jax.random.PRNGKey(3))
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, config.vocab_size, 60) for _ in range(3)]
    fulls = [np.asarray(d.forward(params, config, s[None]))[0] for s in seqs]
    lengths = np.array([9, 17, 4])
    padded = np.zeros((3, 17), np.int32)
    for b in range(3):
        padded[b, :lengths[b]] = seqs[b][:lengths[b]]
    logits, state, _ = D.prefill(params, config, padded, lengths, max_len=64, max_block=4)
    for b in range(3):
        assert np.abs(np.asarray(logits)[b, :lengths[b]] - fulls[b][:lengths[b]]).max() <= TOL
    pos = lengths.copy()
    for step in range(6):
        accept = rng.integers(0, 4, 3)            # 0..3 accepted drafts per sequence
        block = np.stack([seqs[b][pos[b]:pos[b] + 4] for b in range(3)])
        for b in range(3):                        # wrong drafts after the accepted ones
            block[b, accept[b] + 1:] = (block[b, accept[b] + 1:] + 1) % config.vocab_size
        vlog, state, _ = D.verify(params, config, state, block)
        for b in range(3):
            want = fulls[b][pos[b]:pos[b] + accept[b] + 1]
            assert np.abs(np.asarray(vlog)[b, :accept[b] + 1] - want).max() <= TOL, (step, b)
        state = D.commit(state, accept)
        pos += accept + 1
    assert np.asarray(state.pos).tolist() == pos.tolist()


def test_padded_prefill_ignores_padding_content():
    # the shapes of the `model` fixture's tests (B = 2, a prefill block of 16, max_len 64): no new program;
    # 4 and 7 padded positions (a whole CSA window, most of an HCA one)
    config = d.tiny()
    params = d.init_params(config, jax.random.PRNGKey(5))
    tok = np.asarray(jax.random.randint(jax.random.PRNGKey(6), (2, 16), 0, config.vocab_size))
    real = np.arange(16)[None, :] < np.array([[12], [9]])
    a = np.where(real, tok, 0)
    b = np.where(real, tok, 7)
    _, sa, _ = D.prefill(params, config, a, [12, 9], max_len=64)
    _, sb, _ = D.prefill(params, config, b, [12, 9], max_len=64)
    la, _, _ = D.decode_step(params, config, sa, [3, 3])
    lb, _, _ = D.decode_step(params, config, sb, [3, 3])
    np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))


def _params_tokens(config, seed, length):
    """(params, tokens [2, length]) of _setup, without its forward reference (for tests that do not use it)."""
    params = d.init_params(config, jax.random.PRNGKey(seed))
    return params, np.asarray(jax.random.randint(jax.random.PRNGKey(seed + 1), (2, length), 0, config.vocab_size))


def test_no_recompilation_across_calls():
    # the shapes of the `model` fixture's tests (B = 2, max_len 64, max_block 8, blocks of 13, 1 and 5)
    config = d.tiny()
    params, tokens = _params_tokens(config, seed=7, length=64)
    _, state, _ = D.prefill(params, config, tokens[:, :13], max_len=64, max_block=8)
    lg, state, _ = D.decode_step(params, config, state, tokens[:, 13])
    _, state, _ = D.verify(params, config, state, tokens[:, 14:19])
    state = D.commit(state, np.array([1, 2]))
    before = D.process_block._cache_size()
    for i in range(4):
        lg, state, _ = D.decode_step(params, config, state, tokens[:, 17 + i])
        _, state, _ = D.verify(params, config, state, tokens[:, 23:28])
        state = D.commit(state, np.array([0, 3]) if i % 2 else np.array([2, 4]))
    assert D.process_block._cache_size() == before


def test_drafter_outputs_hidden_and_taps():
    config = d.tiny()
    params, tokens = _params_tokens(config, seed=8, length=20)
    _, state, aux = D.prefill(params, config, tokens[:, :12], max_len=32, taps=(1, 4))
    # jitted (op by op, `hidden_states` — the traced body of `forward_jit` — is seconds of dispatch)
    want = np.asarray(jax.jit(d.model.target.hidden_states, static_argnums=1)(params, config, tokens[:, :12]))
    assert aux["hidden"].shape == (2, 12, config.hc_mult, config.hidden_size)
    np.testing.assert_allclose(np.asarray(aux["hidden"]), want, atol=1e-5, rtol=1e-5)
    assert aux["taps"].shape == (2, 12, 2, config.hidden_size)
    # the last tap layer's mean over streams is the mean of the final hidden streams
    np.testing.assert_allclose(np.asarray(aux["taps"])[:, :, 1], want.mean(2), atol=1e-5, rtol=1e-5)
    _, state, aux = D.decode_step(params, config, state, tokens[:, 12], taps=(1, 4))
    assert aux["taps"].shape == (2, 1, 2, config.hidden_size)
    with pytest.raises(ValueError, match="tap layers"):
        D.decode_step(params, config, state, tokens[:, 13], taps=(9,))


def test_capacity_errors():
    config = d.tiny()
    params, tokens = _params_tokens(config, seed=9, length=40)
    with pytest.raises(D.CapacityError, match="sequence 0 would reach 20 tokens.*max_len=16"):
        D.prefill(params, config, tokens[:, :20], max_len=16)
    _, state, _ = D.prefill(params, config, tokens[:, :15], [15, 14], max_len=16, max_block=2)
    _, state, _ = D.decode_step(params, config, state, tokens[:, 15])      # 16, 15: fits
    with pytest.raises(D.CapacityError, match="sequence 0"):
        D.decode_step(params, config, state, tokens[:, 16])
    with pytest.raises(D.CapacityError, match="max_block=2"):
        D.verify(params, config, state, tokens[:, :3])
    with pytest.raises(ValueError, match="lengths"):
        D.prefill(params, config, tokens[:, :5], [6, 1], max_len=16)


def test_flash_state_size_at_1m():
    """Decode state of flash() at max_len 2^20, bf16 (documented in docs/decode_state.md)."""
    b = state_bytes(d.flash(), batch=1, max_len=1 << 20, max_block=8)
    # 21 CSA × (2^20/4 rows × (512 + 128) × 2 B) + 20 HCA × (2^20/128 × 512 × 2 B) ≈ 6.72 GiB (docs/model_math.md §6: 6.7 GiB)
    want = (21 * (1 << 18) * 640 * 2 + 20 * (1 << 13) * 1024)
    assert b["compressed"] + b["indexer_keys"] == want
    assert 6.7 < b["total"] / 2 ** 30 < 6.8
