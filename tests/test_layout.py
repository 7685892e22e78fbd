from __future__ import annotations

import time

import numpy as np
import pytest

import reference as ref
from engram import PRESETS, EngramConfig, Layout
from engram.addressing.layout import layer_multipliers, multiplier_bound


@pytest.fixture(scope="module")
def v41() -> Layout:
    return Layout(EngramConfig.preset("deepseek-v4.1"))


def test_published_primes_and_sums(v41):
    l1, l14 = v41.layers
    assert (l1.layer_id, l14.layer_id) == (1, 14)
    assert min(l1.flat_primes) == 16000057 and max(l1.flat_primes) == 16000463
    assert min(l14.flat_primes) == 16000477 and max(l14.flat_primes) == 16000889
    assert l1.num_embeddings == 384006168
    assert l14.num_embeddings == 384016682
    assert v41.total_rows == 768022850
    assert v41.total_params == 768022850 * 256
    assert round(v41.total_params / 1e9, 1) == 196.6


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_primes_match_plain_search(name):
    c = EngramConfig.preset(name)
    expected = ref.primes(c.layer_ids, c.engram_vocab_size, c.n_heads)
    layout = Layout(c)
    for layer in layout.layers:
        assert [list(o) for o in layer.primes] == expected[layer.layer_id]


def test_primes_are_distinct_across_layers(v41):
    allp = np.concatenate([layer.flat_primes for layer in v41.layers])
    assert np.unique(allp).size == allp.size == 48


def test_offsets_are_exclusive_prefix_sums(v41):
    for layer in v41.layers:
        p = layer.flat_primes
        assert layer.offsets[0] == 0
        assert (layer.offsets[1:] == np.cumsum(p)[:-1]).all()
        assert layer.offsets[-1] + p[-1] == layer.num_embeddings


def test_multipliers_match_vectors_and_reference(vectors, v41):
    for layer in v41.layers:
        assert list(layer.multipliers) == vectors["multipliers"][str(layer.layer_id)]
        assert list(layer.multipliers) == ref.multipliers(layer.layer_id, 4, 99092)


def test_multipliers_odd_and_never_overflow():
    c = EngramConfig.preset("deepseek-v4.1")
    for lid in c.layer_ids:
        m = layer_multipliers(c, lid)
        assert (m % 2 == 1).all()
        # the largest compressed id times any multiplier fits int64, so does the XOR of such products
        assert all((c.compressed_vocab_size - 1) * int(x) < 2**63 for x in m)
    assert multiplier_bound(99092) == (2**63 - 1) // 99092 // 2


def test_prime_search_is_fast():
    t0 = time.perf_counter()
    Layout(EngramConfig.preset("deepseek-v4.1"))
    assert time.perf_counter() - t0 < 1.0


def test_byte_accounting(v41):
    d = v41.to_dict()
    assert d["bytes"]["fp8_ue8m0_row"] == 264
    assert d["bytes"]["fp8_ue8m0_per_token_per_layer"] == 24 * 264
    assert d["bytes"]["fp8_ue8m0_total"] == 768022850 * 264
    assert d["total_params"] == 196613849600


def test_to_dict_per_layer_fields(v41):
    d = v41.to_dict()
    for layer in d["layers"]:
        assert {"layer_id", "primes", "offsets", "num_embeddings", "multipliers"} <= set(layer)
        assert len(layer["primes"]) == 3 and all(len(o) == 8 for o in layer["primes"])
        assert len(layer["offsets"]) == 24
