"""Test helpers for any part, in this repository or a plugin's own tests: the shadow engine and its driver.

``shadow_engine`` builds the real engine, scheduler and paged allocator over a fake model whose KV cache stores
token ids (executor ``shadow``), so every step checks that each request reads back exactly its own tokens;
``drive`` runs a workload of ``Arrival``s through it; ``kv_leaks_checked`` fails a test whose engines end with
KV blocks held. ``framework.testing.properties`` (needs hypothesis) holds the property-test recipe,
``framework.testing.attention`` the float64 reference for attention backends, ``framework.testing.parity`` greedy
parity with transformers, ``framework.testing.registries`` parts a test registers and forgets.

May import: ``common``, ``kv``, ``scheduling``, ``execution``, ``engine``.
"""
from framework.testing.leaks import assert_no_kv_leaks, kv_leaks_checked
from framework.testing.shadow import (EOS, VOCAB, Arrival, Run, ShadowExecutor, drive, next_token, reference_output,
                                      shadow_engine)

__all__ = ["EOS", "VOCAB", "Arrival", "Run", "ShadowExecutor", "assert_no_kv_leaks", "drive", "kv_leaks_checked",
           "next_token", "reference_output", "shadow_engine"]
