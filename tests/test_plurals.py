"""Counts in user-facing messages take the noun's number: "1 request", "2 requests" (swarm.errors.counted)."""

import pytest

from swarm.errors import PlacementError, counted
from swarm.model_format import split_layers


def test_a_count_of_one_takes_the_singular():
    assert [counted(n, "request") for n in (0, 1, 2)] == ["0 requests", "1 request", "2 requests"]
    assert counted(1, "other request") == "1 other request"
    assert counted(3, "entry", "entries") == "3 entries"


def test_a_model_of_one_layer_cannot_be_split_and_is_told_so_in_the_singular():
    with pytest.raises(PlacementError) as refused:
        split_layers(1, [1.0, 1.0])
    assert str(refused.value) == "cannot split 1 layer over 2 stages; use at most 1 stage."
