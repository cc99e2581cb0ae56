"""save_checkpoint writes a parameter tree in the dsv4-convert format: load_checkpoint gives it back."""
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dsv4_jax as d
from dsv4_jax.config import HASH_MOE, MOE, _schedule
from dsv4_jax.io.convert.save import save_checkpoint
from dsv4_jax.drafters.dspark import DSparkConfig
from dsv4_jax.model import params as P
from dsv4_jax.model.params import init_dspark, init_mtp


@pytest.fixture(scope="module")
def model():
    """A random 3-layer target (hash + score MoE, one CSA layer, so a scan segment and unrolled layers) with
    one MTP block and a 2-stage DSpark drafter."""
    types, ratios = _schedule([0, 0, 4])
    config = d.tiny().replace(name="save_test", num_layers=3, layer_types=types, compress_ratios=ratios,
                              mlp_layer_types=(HASH_MOE, MOE, MOE))
    params = d.init_params(config, 0)
    params["mtp"] = init_mtp(config, 1)
    params["dspark"] = init_dspark(config, 2, n_stages=2, n_taps=2, markov_rank=4)
    meta = DSparkConfig(block_size=4, noise_token_id=config.vocab_size - 2, target_layer_ids=(1, 2))
    return config, params, meta


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip(model, tmp_path, dtype):
    """Every leaf comes back (loaded as float32): exactly, or rounded through bfloat16 for the weight leaves
    of a bfloat16 save; the float32 leaves (norms, HC, sinks, biases) and int32 tid2eid always exactly."""
    config, params, meta = model
    out = tmp_path / "new" / "ckpt"
    save_checkpoint(out, config, params, dspark_meta=meta, dtype=dtype)
    got_config, got = d.load_checkpoint(out, dtype=jnp.float32)
    assert got_config.target == config and got_config.mtp_layers == 1
    m = got_config.dspark
    assert (m.n_stages, m.n_taps, m.markov_rank, m.conf_bias) == (2, 2, 4, False)
    assert (m.block_size, m.noise_token_id, m.target_layer_ids) == (4, config.vocab_size - 2, (1, 2))
    specs = dict(P.param_specs(config), mtp=[P.mtp_specs(config)], dspark=P.dspark_specs(config, 2, 2, 4, False))
    kinds = {k: s.kind for k, s in P.flatten(specs).items()}
    want, have = P.flatten(params), P.flatten(got)
    assert set(want) == set(have) == set(kinds)
    assert {"weight", "f32", "index"} <= set(kinds.values())
    for k, w in want.items():
        w = np.asarray(w)
        if kinds[k] == "weight" and dtype == "bfloat16":
            w = w.astype(ml_dtypes.bfloat16).astype(np.float32)
        h = np.asarray(have[k])
        assert h.dtype == w.dtype, k
        np.testing.assert_array_equal(h, w, err_msg=k)


def test_incomplete_params_leave_nothing(model, tmp_path):
    config, params, _ = model
    broken = dict(params, norm=None)
    del broken["norm"]
    with pytest.raises(ValueError, match="lack leaves.*norm"):
        save_checkpoint(tmp_path / "new" / "ckpt", config, broken)
    assert os.listdir(tmp_path) == []
