"""The serving engine: ``LLMEngine`` (online) and ``LLM`` (offline) over a scheduler and an executor.

May import: ``common``, ``kv``, ``scheduling``, ``execution``, ``models``.
"""
