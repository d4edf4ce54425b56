"""Running a step: executors, model runner, input preparers, the attention interface, sampler.

May import: ``common``, ``kv``, ``scheduling``, ``models``.
"""
