"""KV-block bookkeeping: the ``BlockAllocator`` interface and its implementations (``allocators/``).

May import: ``common``.
"""
