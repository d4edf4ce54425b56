"""``python -m framework.compare DIR... [--out OUT] [--x KEY] [--label KEY,...]``: compare runs.

The command itself lives in ``framework/harness/compare.py``.
"""
import sys

from framework.harness.compare import main

if __name__ == "__main__":
    sys.exit(main())
