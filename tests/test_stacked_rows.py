"""Compressed-row tables written in place: `model.layers.compressor.write_rows` on a plain [B, T, c] table and on a
`model.inplace.StackedRows` (the table inside its segment's [reps, B, T, c] buffer), both the per-row
dynamic_update_slice path and the scatter path for many rows, against a numpy loop; `inplace.take_rows`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.model.inplace import StackedRows, rows_of, take_rows
from dsv4_jax.model.layers import compressor


def _numpy_write(table, rows, index, ok):
    out = table.copy()
    for b in range(index.shape[0]):
        for j in range(index.shape[1]):
            if ok[b, j]:
                out[b, index[b, j]] = rows[b, j]
    return out


@pytest.mark.parametrize("B,J", [(3, 2), (1, 1), (40, 2)])          # 40·2 > ROW_UPDATES_MAX: the scatter path
def test_write_rows_plain_and_stacked_match_numpy(B, J):
    rng = np.random.default_rng(B * 10 + J)
    T, c, reps = 6, 3, 3
    slab = rng.normal(size=(reps, B, T, c)).astype(np.float32)
    rows = rng.normal(size=(B, J, c)).astype(np.float32)
    index = rng.integers(0, T + 2, size=(B, J)).astype(np.int32)     # some past the end (never ok)
    ok = (rng.random((B, J)) < 0.7) & (index < T)
    if J > 1:                                                        # a not-ok window after an ok one on its row
        index[0, 1], ok[0, 1], ok[0, 0] = index[0, 0], False, index[0, 0] < T
    plain = jax.jit(compressor.write_rows)(slab[1], rows, index, ok)
    np.testing.assert_array_equal(np.asarray(plain), _numpy_write(slab[1], rows, index, ok))
    stacked = jax.jit(lambda s, r: compressor.write_rows(StackedRows(s, r), rows, index, ok))(slab, jnp.int32(1))
    assert isinstance(stacked, StackedRows)
    want = slab.copy()
    want[1] = _numpy_write(slab[1], rows, index, ok)
    np.testing.assert_array_equal(np.asarray(stacked.slab), want)    # the other reps untouched
    np.testing.assert_array_equal(np.asarray(rows_of(stacked)), want[1])


def test_take_rows_stacked_equals_plain():
    rng = np.random.default_rng(0)
    slab = jnp.asarray(rng.normal(size=(3, 2, 7, 4)).astype(np.float32))
    sel = jnp.asarray(rng.integers(0, 7, size=(2, 3, 5)))
    for r in range(3):
        want = np.stack([np.asarray(slab[r, b])[np.asarray(sel[b])] for b in range(2)])
        for split in (True, False):
            got = jax.jit(lambda s, i: take_rows(StackedRows(s, i), sel, batch_split=split))(slab, jnp.int32(r))
            assert got.shape == (2, 3, 5, 4)
            np.testing.assert_array_equal(np.asarray(got), want)
        np.testing.assert_array_equal(np.asarray(take_rows(slab[r], sel)), want)
