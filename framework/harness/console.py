"""What a finished run tells its console: where its files are, whether its times are simulated, and how to
upload an offline W&B run."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def simulated_note(summary: dict[str, Any], progress: bool = True) -> str | None:
    """The line saying a simulated run's times are simulated (and, with a ``progress`` bar, that its rate was not);
    None for a real run. A simulated executor names its device (``hardware``) in the summary, a real one does not."""
    if summary.get("hardware") is None:
        return None
    bar = "; the progress bar's req/s was wall-clock" if progress else ""
    return f"simulated run ({summary['hardware']}): its durations, latencies and throughputs are simulated seconds{bar}"


def wandb_sync_line(run_dir: Path) -> str | None:
    """``wandb sync PATH`` for the newest offline W&B run under ``run_dir`` (``logger=wandb`` offline); else None."""
    runs = sorted((run_dir / "wandb").glob("offline-run-*"), key=lambda p: p.stat().st_mtime)
    return f"upload to W&B with: wandb sync {runs[-1]}" if runs else None


def finished_lines(run_dir: Path, summary: dict[str, Any], progress: bool = True) -> list[str]:
    """The lines printed after a run's summary table (``progress``: whether a progress bar was shown)."""
    lines = [note for note in (simulated_note(summary, progress), wandb_sync_line(run_dir)) if note]
    return [*lines, f"results: {run_dir}"]
