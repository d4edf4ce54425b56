"""Scheduling: the ``Scheduler`` mechanism, the ``SchedulerPolicy`` interface, ``SchedulerOutput``.

May import: ``common``, ``kv``.
"""
