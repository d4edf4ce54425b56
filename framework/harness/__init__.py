"""Experiments: the command, runs, the cluster loop, workloads, recorder, metrics, loggers, plots, comparison.

May import: ``common``, ``kv``, ``scheduling``, ``execution``, ``engine``, ``sim``, ``models``.
"""
