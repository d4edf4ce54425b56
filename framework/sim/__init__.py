"""Simulation: the sim executor, cost models, hardware, calibration and profiling, fast-forward, routers.

May import: ``common``, ``kv``, ``scheduling``, ``execution``, ``engine``, ``models``.
"""
