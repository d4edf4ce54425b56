"""Linux /proc helpers for tests that watch processes end."""
from pathlib import Path


def children(pid: int, name: str) -> list[int]:
    """Process ids of ``pid``'s children whose command line holds ``name``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and name.encode() in cmdline:
            found.append(int(stat.parent.name))
    return found
