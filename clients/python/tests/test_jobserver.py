"""The fallback on a real GNU make jobserver: pytest runs jobserver_inner.py
inside a make recipe, with make 4.3 (a pipe, `R,W`) and make 4.4.1 (a FIFO,
`fifo:PATH`). make itself checks at exit that every token came back."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest

from baton_client._jobserver import auth_from_makeflags, from_environment

HERE = pathlib.Path(__file__).resolve().parent


def make(env: str, fallback: str) -> str:
    path = os.environ.get(env) or fallback
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} not found ({env} unset or wrong): run scripts/test, which installs it")
    return path


@pytest.mark.parametrize("env,fallback,style", [("BATON_TEST_MAKE43", "/usr/bin/make", r"\d+,\d+"), ("BATON_TEST_MAKE44", os.path.join(os.path.dirname(sys.executable), "make"), "fifo:")])
def test_the_client_takes_tokens_from_a_real_make_jobserver(tmp_path, env, fallback, style):
    (tmp_path / "Makefile").write_text(
        "all:\n\t@echo \"auth: $(filter --jobserver-auth=%,$(MAKEFLAGS))\"\n"
        # -p no:baton: these tests count the jobserver's tokens themselves,
        # so the pytest plugin must not hold one around each of them.
        "\t+@$(PY) -m pytest -q -p no:cacheprovider -p no:baton $(INNER)\n"
    )
    environment = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    environment["BATON_SOCKET"] = str(tmp_path / "no-broker-here")
    run = subprocess.run(
        [make(env, fallback), "-j3", "-C", str(tmp_path), f"PY={sys.executable}", f"INNER={HERE / 'jobserver_inner.py'}"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert re.search(f"--jobserver-auth={style}", out), out
    assert "4 passed" in out, out
    assert "INTERNAL" not in out, out  # make's own check: every token back at exit


def test_the_last_jobserver_option_in_makeflags_wins():
    """GNU make's manual ("POSIX Jobserver Interaction"): where MAKEFLAGS
    holds more than one jobserver option, the last one is the one in
    force; an earlier one may name descriptors long closed."""
    assert auth_from_makeflags("-j4 --jobserver-auth=3,4 --jobserver-auth=fifo:/tmp/js") == "fifo:/tmp/js"
    assert auth_from_makeflags("--jobserver-fds=5,6 -j --jobserver-auth=7,8") == "7,8"
    assert auth_from_makeflags("-j4") is None
    assert auth_from_makeflags(None) is None


def test_a_pipe_named_in_makeflags_serves_only_if_it_is_one_pipe_the_right_way_round(monkeypatch):
    """make 4.3 names its pipe by descriptor numbers, which outside a
    recipe with '+' may be other files by now (pytest's capture dups into
    the lowest free ones): a byte read from such a file would be a token
    made up. Only the read end then the write end of one pipe is taken."""
    r, w = os.pipe()
    other_r, other_w = os.pipe()
    try:
        monkeypatch.setenv("MAKEFLAGS", f"-j --jobserver-auth={r},{w}")
        jobserver = from_environment()
        assert jobserver is not None
        os.write(w, b"+")
        assert jobserver.take_now(1) == b"+"
        assert jobserver.take_now(1) is None
        jobserver.give(b"+")
        jobserver.close()
        assert os.read(r, 1) == b"+", "the token went back into make's pipe"
        with tempfile.TemporaryFile() as file:
            f = file.fileno()
            for auth in (f"{w},{r}", f"{w},{w}", f"{r},{other_w}", f"{f},{f}", "-1,-1", "3,x"):
                monkeypatch.setenv("MAKEFLAGS", f"-j --jobserver-auth={auth}")
                assert from_environment() is None, f"{auth} was taken for a jobserver"
    finally:
        for fd in (r, w, other_r, other_w):
            os.close(fd)
