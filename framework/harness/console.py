"""What a finished run tells its console: where its files are, whether its times are simulated, and how to
upload an offline W&B run."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def simulated_note(summary: dict[str, Any]) -> str | None:
    """The line saying a simulated run's times are simulated; None for a real run. A simulated executor names
    its device (``hardware``) in the summary, a real one does not."""
    if summary.get("hardware") is None:
        return None
    return (f"simulated run ({summary['hardware']}): its durations, latencies and throughputs are simulated "
            f"seconds; the progress bar's req/s was wall-clock")


def wandb_sync_line(run_dir: Path) -> str | None:
    """``wandb sync PATH`` for the newest offline W&B run under ``run_dir`` (``logger=wandb`` offline); else None."""
    runs = sorted((run_dir / "wandb").glob("offline-run-*"), key=lambda p: p.stat().st_mtime)
    return f"upload to W&B with: wandb sync {runs[-1]}" if runs else None


def finished_lines(run_dir: Path, summary: dict[str, Any]) -> list[str]:
    """The lines printed after a run's summary table."""
    lines = [note for note in (simulated_note(summary), wandb_sync_line(run_dir)) if note]
    return [*lines, f"results: {run_dir}"]
