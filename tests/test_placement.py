import pytest

from swarm.errors import PlacementError
from swarm.leader.planning.placement import FellowCapacity, ModelSize, place
from swarm.model_format import split_layers

GB = 10**9


def size(layers=30, per_layer=10_000_000):
    return ModelSize(
        layer_bytes=(per_layer,) * layers,
        embed_bytes=50_000_000,
        final_bytes=1_000,
        tied_embeddings=True,
        kv_bytes_per_token_per_layer=1_000,
    )


def test_split_is_proportional_contiguous_and_covers_every_layer():
    assert split_layers(30, [1, 1]) == [(0, 15), (15, 30)]
    assert split_layers(30, [2, 1]) == [(0, 20), (20, 30)]
    slices = split_layers(7, [100, 1, 1])
    assert slices[0][0] == 0 and slices[-1][1] == 7
    assert all(end > first for first, end in slices)
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))


def test_split_refuses_more_stages_than_layers():
    with pytest.raises(PlacementError, match="at most 3 stages"):
        split_layers(3, [1, 1, 1, 1])


def test_place_two_equal_fellows_gets_half_each_and_last_holds_tied_head():
    fellows = [FellowCapacity(1, "a", 8 * GB), FellowCapacity(2, "b", 8 * GB)]
    plans = place(size(), fellows, 2, 4096)
    assert [(p.first_layer, p.end_layer) for p in plans] == [(0, 15), (15, 30)]
    assert plans[1].weight_bytes == plans[0].weight_bytes + 1_000  # both carry the embedding (tied head)
    assert [p.fellow_name for p in plans] == ["a", "b"]


def test_place_refuses_with_the_numbers():
    fellows = [FellowCapacity(1, "gpu-1", int(0.3 * GB)), FellowCapacity(2, "gpu-2", 8 * GB)]
    with pytest.raises(PlacementError) as err:
        place(size(per_layer=100_000_000), fellows, 2, 8192)
    message = str(err.value)
    assert "on gpu-1 needs" in message and "KV cache at 8192 tokens" in message and "0.3 GB free" in message


def test_place_needs_enough_fellows():
    with pytest.raises(PlacementError, match="needs 3 fellows online"):
        place(size(), [FellowCapacity(1, "a", GB)], 3, 4096)


def test_place_picks_the_roomiest_fellows():
    fellows = [FellowCapacity(i, f"f{i}", free) for i, free in enumerate([1 * GB, 9 * GB, 5 * GB])]
    plans = place(size(), fellows, 2, 1024)
    assert {p.fellow_name for p in plans} == {"f1", "f2"}


def test_one_fellow_needs_the_weights_plus_a_gigabyte_and_names_each_fellows_room():
    from swarm.leader.planning.placement import ONE_FELLOW_HEADROOM

    model = size(per_layer=100_000_000)
    weights = sum(model.layer_bytes) + model.embed_bytes + model.final_bytes
    need = weights + ONE_FELLOW_HEADROOM
    fellows = [FellowCapacity(1, "fxserver", int(1.2 * GB)), FellowCapacity(2, "fxserver96", int(2.3 * GB)),
               FellowCapacity(3, "big", need)]
    (plan,) = place(model, fellows, 1, 4096)
    assert (plan.fellow_name, plan.first_layer, plan.end_layer) == ("big", 0, len(model.layer_bytes))
    (plan,) = place(model, fellows, 1, 4096, fellow_id=3)
    assert plan.fellow_id == 3
    with pytest.raises(PlacementError) as refused:
        place(model, fellows[:2], 1, 4096)
    assert str(refused.value).startswith(f"The model needs {need / GB:.1f} GB free on one fellow: fxserver has 1.2 GB "
                                         "free; fxserver96 has 2.3 GB free.")
    with pytest.raises(PlacementError, match="fxserver has 1.2 GB free"):
        place(model, fellows, 1, 4096, fellow_id=1)
    with pytest.raises(PlacementError, match="not online"):
        place(model, fellows, 1, 4096, fellow_id=9)
    with pytest.raises(PlacementError, match="--num-stages 1"):
        place(model, fellows, 2, 4096, fellow_id=1)
