"""``python -m framework.profile``: measure the real executor, fit a cost model, write a YAML.

The command itself lives in ``framework/sim/profile.py``.
"""
from framework.sim.profile import main

if __name__ == "__main__":
    main()
