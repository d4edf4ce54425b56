"""The OpenAI-compatible HTTP server: settings, the engine's stepping thread, endpoints, Prometheus metrics, the command.

May import: ``common``, ``kv``, ``scheduling``, ``execution``, ``engine``, ``sim``, ``harness``, ``models``.
"""
