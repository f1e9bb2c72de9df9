"""The KV cache that grows in place holds exactly what transformers' concatenating one holds,
through appends, tree compaction and growth, and copies the cache only when its room runs out."""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from cloud_server.engine.kv_cache import ReservedLayer, room_for, whole_cache
from cloud_server.engine.kv_cache import keep_path
from testkit.device_under_test import DEVICE

HEADS, DIM = 3, 4


def states(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(1, HEADS, n, DIM, generator=g) for _ in range(2))
    return keys.to(DEVICE), values.to(DEVICE)


def both(layers: int = 2, most_positions: int | None = None) -> tuple[DynamicCache, DynamicCache]:
    plain = DynamicCache()
    plain.layers = [DynamicLayer() for _ in range(layers)]
    reserved = DynamicCache()
    reserved.layers = [ReservedLayer(most_positions) for _ in range(layers)]
    return plain, reserved


def append(caches: tuple[DynamicCache, ...], n: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """Appends the same n positions to every layer of each cache; what update returned."""
    returned = []
    for cache in caches:
        for layer in range(len(cache.layers)):
            returned.append(cache.update(*states(n, seed + layer), layer))
    return returned


def assert_same(plain: DynamicCache, reserved: DynamicCache) -> None:
    for a, b in zip(plain.layers, reserved.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert plain.get_seq_length() == reserved.get_seq_length()


def test_appends_compactions_and_growth_hold_what_concatenation_holds():
    plain, reserved = both()
    append((plain, reserved), 300, seed=0)  # a prompt: past a new buffer's room at once
    for step in range(40):
        base = plain.get_seq_length()
        append((plain, reserved), 9, seed=10 + step)  # pending token + an 8-node tree
        accepted = (0, 3, 4)[: step % 4]
        keep_path(plain, base, accepted)
        keep_path(reserved, base, accepted)
        assert_same(plain, reserved)


def test_what_attention_is_handed_is_the_whole_cache():
    plain, reserved = both(layers=1)
    append((plain, reserved), 5, seed=0)
    (k_plain, v_plain), (k_reserved, v_reserved) = append((plain, reserved), 2, seed=1)
    assert torch.equal(k_plain, k_reserved) and torch.equal(v_plain, v_reserved)
    assert k_reserved.shape == (1, HEADS, 7, DIM)


def test_an_append_with_room_copies_nothing_and_a_full_buffer_grows_once():
    _, reserved = both(layers=1)
    append((reserved,), 10, seed=0)
    layer = reserved.layers[0]
    start = layer.keys.data_ptr()
    for step in range(room_for(10) - 10):  # the room the buffer got
        append((reserved,), 1, seed=step)
        assert layer.keys.data_ptr() == start
    append((reserved,), 1, seed=99)
    assert layer.keys.data_ptr() != start  # full: one new buffer, with room again
    grown = layer.keys.data_ptr()
    append((reserved,), 1, seed=100)
    assert layer.keys.data_ptr() == grown


def test_the_room_stops_at_the_sessions_most_positions():
    _, reserved = both(layers=1, most_positions=20)
    append((reserved,), 10, seed=0)
    assert reserved.layers[0]._buffers[0].shape[-2] == 20
    append((reserved,), 15, seed=1)  # past it (a session never goes there): room for them all
    assert reserved.layers[0].get_seq_length() == 25


def test_tensors_swapped_under_it_are_taken_as_they_are():
    plain, reserved = both(layers=1)
    append((plain, reserved), 6, seed=0)
    for cache in (plain, reserved):  # something outside the cache replaces its tensors
        layer = cache.layers[0]
        layer.keys, layer.values = layer.keys[..., 1:, :].clone(), layer.values[..., 1:, :].clone()
    append((plain, reserved), 3, seed=1)
    assert_same(plain, reserved)


def test_a_sessions_cache_grows_in_place_on_the_cpu_within_what_admission_counted(tiny_target):
    from cloud_server.decoding.session import Session
    from shared.messages import Limits, OpenRequest

    limits = Limits(max_tree_nodes=8, max_tree_depth=4, max_new_tokens=16)
    session = Session.open(tiny_target, limits,
                           OpenRequest(prompt_ids=(1, 5, 6, 7), max_new_tokens=16))
    session.prefill()
    layers = session._kv.layers
    if tiny_target.device.type != "cpu":  # a host-bound forward there: transformers' own cache
        assert layers and all(type(layer) is DynamicLayer for layer in layers)
        return
    assert layers and all(type(layer) is ReservedLayer for layer in layers)
    assert all(layer._buffers[0].shape[-2] <= session.most_positions for layer in layers)
    assert whole_cache(tiny_target.model.config, True).layers[0].most_positions is None
