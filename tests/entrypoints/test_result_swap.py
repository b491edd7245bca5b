"""``patchbay run``'s results swap (issue 57, item 13): a job that stops early never replaces an earlier job's
complete results (its own go beside them), and a job killed outright leaves no hidden ``.partial`` file behind
once the next job on that target has started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from patchbay.entrypoints import result_file


def _complete(path: Path, ids: list[str]) -> bytes:
    results = result_file.ResultFile(path)
    for request_id in ids:
        results.write({"id": request_id, "text": "done"})
    results.close()
    return path.read_bytes()


def test_a_stopped_job_keeps_the_earlier_complete_results_and_puts_its_own_beside_them(tmp_path):
    target = tmp_path / "results.jsonl"
    before = _complete(target, ["a", "b"])
    stopped = result_file.ResultFile(target)
    stopped.write({"id": "c", "text": "half"})
    where = stopped.close("RuntimeError: the disk is full", num_requests=3)
    assert target.read_bytes() == before, "a stopped job's partial results replaced complete ones"
    kept = [json.loads(line) for line in where.read_text().splitlines()]
    assert where != target and where.parent == target.parent
    assert kept == [
        {"id": "c", "text": "half"},
        {"error": "RuntimeError: the disk is full", "num_results": 1, "num_requests": 3},
    ]
    # A stopped job's own results are not complete: the next stopped job may replace them in place.
    again = result_file.ResultFile(where)
    again.write({"id": "d", "text": "half"})
    assert again.close("KeyboardInterrupt", num_requests=2) == where
    # A job that finishes replaces the complete results, as always.
    assert _complete(target, ["e"]) != before


def test_a_job_killed_outright_leaves_no_partial_file_once_the_next_job_starts(tmp_path):
    target = tmp_path / "results.jsonl"
    before = _complete(target, ["a"])
    script = textwrap.dedent(
        f"""
        import os, signal
        from pathlib import Path
        from patchbay.entrypoints.result_file import ResultFile

        results = ResultFile(Path({str(target)!r}))
        results.write({{"id": "b"}})
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert target.read_bytes() == before
    result_file.ResultFile(target).close()  # the next job on the same target
    leftovers = [entry.name for entry in tmp_path.iterdir() if entry.name.endswith(".partial")]
    assert leftovers == [], f"a killed job's results file stayed behind: {leftovers}"
    assert sorted(os.listdir(tmp_path)) == ["results.jsonl"]
