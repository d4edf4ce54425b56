import torch

from backends.naive import write_kv


def test_write_kv_stores_only_the_rows_the_slot_mapping_covers():
    """Rows past the slot mapping (a batch padded to a captured graph's size) are not written anywhere."""
    kv_cache = torch.zeros(2, 3, 4, 1, 2)
    k = torch.arange(10.0).view(5, 1, 2) + 1
    v = -k
    write_kv(k, v, kv_cache, torch.tensor([5, 0, 11]))
    flat = kv_cache.view(2, -1, 1, 2)
    assert torch.equal(flat[0, [5, 0, 11]], k[:3]) and torch.equal(flat[1, [5, 0, 11]], v[:3])
    assert int((flat != 0).any(dim=(-1, -2)).sum()) == 6
