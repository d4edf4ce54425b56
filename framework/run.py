"""``python -m framework.run [+policy=NAME] [backend=NAME] [key=value ...]``: the experiment command.

The command itself lives in ``framework/harness/run.py``.
"""
from framework.harness.experiment import engine_config
from framework.harness.run import cli, main

__all__ = ["cli", "engine_config", "main"]

if __name__ == "__main__":
    cli()
