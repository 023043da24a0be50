"""``mctier demo`` (the README's first command) runs, prints its summary, exits 0 and leaves
no process behind."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from tests.harness import ROOT

pytestmark = pytest.mark.e2e


def _our_processes() -> set[int]:
    """PIDs of running engines, masters, store servers and proxies on this machine (not
    zombies: a killed engine worker whose parent died first stays one until init reaps
    it, which takes this machine's init about 2 s)."""
    out = subprocess.run(["pgrep", "-f", "VLLM::|mooncake_master|mcstore.segment|multi.cli"],
                         capture_output=True, text=True).stdout
    live = set()
    for pid in map(int, out.split()):
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                live.add(pid)
        except psutil.NoSuchProcess:
            pass
    return live


def test_demo_runs_and_cleans_up(tmp_path):
    before = _our_processes()
    r = subprocess.run([sys.executable, "-m", "multi.cli", "demo", "--log-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=900, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    for needle in ("TTFT median ms", "store hit rate", "bytes moved", "mctier inspect", "stopped all processes"):
        assert needle in out, out
    # Per-request lines: "[demo] KIND N tokens -> PLAN TTFT ..."; the workload must exercise
    # both a loading plan and local computation.
    plans = {line.split("->")[1].split()[0] for line in out.splitlines() if line.startswith("[demo]") and "->" in line}
    assert plans & {"p2p", "store+p2p", "store"} and "recompute" in plans, plans
    # A SIGKILLed process can take a moment to die: allow 10 s, then nothing may be left.
    deadline = time.monotonic() + 10
    while (leftovers := _our_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers, f"processes left behind: {leftovers}"
