"""The vocabulary every layer shares: config, requests, sampling params, outputs, clocks, registry.

May import: no other layer (and never torch: simulated runs must not load it).
"""
