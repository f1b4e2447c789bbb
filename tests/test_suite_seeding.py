"""The suite's own seeding (tests/conftest.py): a fixture of wider scope draws from a seed of its own,
whatever test of the shuffled order builds it first."""
from __future__ import annotations

import zlib

import pytest
import torch


@pytest.fixture(scope="module")
def drawn_weights() -> torch.Tensor:
    return torch.rand(4)


def expected(request) -> torch.Tensor:
    module = request.node.nodeid.split("::")[0]
    generator = torch.Generator().manual_seed(zlib.crc32(f"{module}::drawn_weights[0]".encode()))
    return torch.rand(4, generator=generator)


def test_a_module_fixture_draws_from_its_own_seed(drawn_weights, request):
    torch.rand(7)  # what a test draws does not reach the fixture's draw
    assert torch.equal(drawn_weights, expected(request))


def test_the_same_fixture_seen_from_another_test_is_the_same_draw(drawn_weights, request):
    torch.rand(3)
    assert torch.equal(drawn_weights, expected(request))
