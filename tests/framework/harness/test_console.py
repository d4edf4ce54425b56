"""What a finished run prints after its summary: simulated times said so, the `wandb sync` line of an offline W&B
run, and where its files are."""
import os

from framework.harness.console import finished_lines


def test_a_real_run_says_where_its_files_are(tmp_path):
    assert finished_lines(tmp_path, {"status": "completed", "device": "cpu"}) == [f"results: {tmp_path}"]


def test_a_simulated_offline_wandb_run_says_its_times_are_simulated_and_how_to_upload_it(tmp_path):
    offline = tmp_path / "wandb" / "offline-run-20261127_120000-abc"
    offline.mkdir(parents=True)
    lines = finished_lines(tmp_path, {"status": "completed", "hardware": "h100-sxm"})
    assert lines[0].startswith("simulated run (h100-sxm): its durations, latencies and throughputs are simulated")
    assert "wall-clock" in lines[0]
    assert lines[1:] == [f"upload to W&B with: wandb sync {offline}", f"results: {tmp_path}"]


def test_a_simulated_run_without_a_progress_bar_says_nothing_of_one(tmp_path):
    (line, _) = finished_lines(tmp_path, {"status": "completed", "hardware": "h100-sxm"}, progress=False)
    assert line == "simulated run (h100-sxm): its durations, latencies and throughputs are simulated seconds"


def test_the_wandb_sync_line_names_the_newest_offline_run(tmp_path):
    runs = [tmp_path / "wandb" / f"offline-run-2026112{i}_120000-{name}" for i, name in ((7, "old"), (9, "new"))]
    for age, run in zip((200, 100), runs):
        run.mkdir(parents=True)
        os.utime(run, (run.stat().st_atime, run.stat().st_mtime - age))
    assert f"upload to W&B with: wandb sync {runs[1]}" in finished_lines(tmp_path, {"status": "completed"})
