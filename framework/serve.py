"""``python -m framework.serve [key=value ...]``: the OpenAI-compatible server command (docs/server.md).

The command itself lives in ``framework/server/command.py``.
"""
from framework.server.command import cli, main

__all__ = ["cli", "main"]

if __name__ == "__main__":
    cli()
