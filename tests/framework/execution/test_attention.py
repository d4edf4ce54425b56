"""The attention interface's shared checks: a backend declares its limits and construction names
every one the settings break."""
import pytest
import torch

from backends.naive import NaiveBackend


class Limited(NaiveBackend):
    name = "limited"
    supported_dtypes = (torch.float16,)
    max_head_size = 64
    block_size_multiple = 32


def create(cls, head_dim=64, block_size=32, dtype=torch.float16):
    return cls(num_heads=2, num_kv_heads=2, head_dim=head_dim, scale=1.0, block_size=block_size, dtype=dtype,
               device="cpu")


def test_settings_within_the_limits_are_accepted():
    assert create(Limited).block_size == 32


def test_every_broken_limit_is_named_at_once():
    with pytest.raises(ValueError) as err:
        create(Limited, head_dim=128, block_size=16, dtype=torch.float32)
    message = str(err.value)
    assert "'limited' cannot run" in message
    assert "dtype torch.float32 is not supported, only float16" in message
    assert "head sizes up to 64" in message
    assert "block_size=16 is not a multiple of 32" in message and "engine.block_size=32" in message


def test_the_limits_are_readable_before_building():
    assert Limited.unsupported(64, 64, torch.float16) == []
    assert len(Limited.unsupported(65, 48, torch.bfloat16)) == 3
    assert NaiveBackend.unsupported(512, 3, torch.float32) == []


def test_query_heads_must_split_evenly_over_the_kv_heads():
    with pytest.raises(ValueError, match="num_heads=3 is not a multiple of num_kv_heads=2"):
        NaiveBackend(num_heads=3, num_kv_heads=2, head_dim=16, scale=1.0, block_size=16, dtype=torch.float32,
                     device="cpu")
