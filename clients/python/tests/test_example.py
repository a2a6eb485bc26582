"""A fresh virtual environment installs the package with pip and runs the
example pool against the real broker."""

from __future__ import annotations

import os
import re
import subprocess
import venv

from conftest import REPO
from test_client import all_free

PACKAGE = REPO / "clients" / "python"


def test_a_fresh_venv_installs_the_package_and_runs_the_example(start_broker, tmp_path):
    broker = start_broker(2)
    venv.create(tmp_path / "venv", with_pip=True)
    python = str(tmp_path / "venv" / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", str(PACKAGE)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed copy, not the source tree
    env["BATON_SOCKET"] = broker.socket
    out = subprocess.run([python, str(PACKAGE / "examples" / "pool.py")], env=env, capture_output=True, text=True, timeout=120, check=True).stdout
    peak = int(re.search(r"16 tasks done, sum of squares 1240, at most (\d+) at once", out).group(1))
    assert 1 <= peak <= 2, out
    assert all_free(broker)["totals"]["granted"] == 16
