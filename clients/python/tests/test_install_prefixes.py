"""pip installs the client where it is told, every time (issue #40): from
one source tree into a first prefix, then a second, then from a wheel built
by `pip wheel` into a third. Nothing installed names the source tree's
build/ directory or an earlier prefix, and each prefix imports on its own,
the first one gone.

No network: the build backend (flit_core) comes from the wheelhouse
scripts/test fills (target/test-venv/wheelhouse, or BATON_TEST_WHEELHOUSE).

What may name the source tree: only each install's `direct_url.json`,
pip's standard record of where the distribution came from (PEP 610:
`{"url": ..., "dir_info": {}}` for a directory, `archive_info` for a wheel),
read by `pip freeze` and importlib.metadata, never to find code. It is
checked to be exactly that record, of the source this install came from,
and like every other file (RECORD included) it must name neither build/
nor an earlier prefix.

Not `pip install --target`: pip installs into a temporary directory first
and moves the files, so the .pyc files it compiles name
/tmp/pip-target-XXXX/lib/python/..., a directory gone after the install
(harmless: the import system takes the path of the .py beside the .pyc).
That is pip's, not this package's.
"""

from __future__ import annotations

import json
import os
import importlib.metadata
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest
from conftest import REPO

PACKAGE = REPO / "clients" / "python"


def wheelhouse() -> pathlib.Path:
    path = pathlib.Path(os.environ.get("BATON_TEST_WHEELHOUSE") or REPO / "target" / "test-venv" / "wheelhouse")
    if not list(path.glob("flit_core-*.whl")):
        pytest.fail(f"no flit_core wheel in {path} (BATON_TEST_WHEELHOUSE unset or wrong): run scripts/test, which downloads it")
    return path


def clean_env() -> dict:
    """No PYTHONPATH (the source tree), no user or site pip configuration
    (an index, --user, --target)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def pip(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", *args[:1], "-q", "--disable-pip-version-check", "--no-input", "--no-index", *args[1:]],
        check=True,
        timeout=300,
        env=clean_env(),
    )


def spellings(path: pathlib.Path) -> set[bytes]:
    """A path as given and with its symlinks resolved (/tmp may be a link)."""
    return {os.fsencode(str(path)), os.fsencode(os.path.realpath(path))}


def files_under(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def site_dir(prefix: pathlib.Path) -> pathlib.Path:
    """Where the package landed under `prefix` (lib/pythonX.Y/site-packages,
    or whatever this Python's scheme says)."""
    found = [p.parent.parent for p in prefix.rglob("baton_client/__init__.py")]
    assert len(found) == 1, f"baton_client installed {len(found)} times under {prefix}: {found}"
    return found[0]


def check_direct_url(path: pathlib.Path, source: pathlib.Path) -> None:
    record = json.loads(path.read_text())
    assert record.get("url") == source.resolve().as_uri(), f"{path} says it came from {record.get('url')}, not {source}"
    kinds = set(record) - {"url"}
    assert kinds in ({"dir_info"}, {"archive_info"}), f"{path} is not pip's PEP 610 record: {record}"
    if "dir_info" in record:
        assert record["dir_info"] in ({}, {"editable": False}), f"{path}: {record}"


def check_tree(prefix: pathlib.Path, source: pathlib.Path, earlier: list[pathlib.Path]) -> None:
    """Nothing under `prefix` names the source tree's build/ or an earlier
    prefix; nothing but direct_url.json names the source tree."""
    build = spellings(PACKAGE / "build")
    gone = set().union(*(spellings(p) for p in earlier))
    tree = spellings(PACKAGE)
    files = files_under(prefix)
    assert any(f.name == "RECORD" for f in files), f"no RECORD under {prefix}"
    for file in files:
        data = file.read_bytes()
        for needle in build | gone:
            if needle in data:
                pytest.fail(f"{file} names {needle.decode()}")
        if file.name == "direct_url.json":
            check_direct_url(file, source)
            continue
        for needle in tree:
            if needle in data:
                pytest.fail(f"{file} names the source tree {needle.decode()}")


def check_import(prefix: pathlib.Path, cwd: pathlib.Path) -> None:
    """`import baton_client` with nothing but `prefix` added to Python's own
    path: -I (no PYTHONPATH, no user site, no script directory), -S (not
    even this venv's site-packages, where scripts/test installs the client),
    then the prefix's site-packages as a site directory (.pth files too)."""
    site = site_dir(prefix)
    code = "import site, sys; site.addsitedir(sys.argv[1]); import baton_client; print(baton_client.__file__)"
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, str(site)], cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, f"import baton_client from {prefix}: {out.stderr}"
    loaded = pathlib.Path(out.stdout.strip())
    assert loaded.is_relative_to(site), f"baton_client came from {loaded}, not from {site}"


def installed_files() -> list | None:
    """The files of the client installed where this pytest runs, if any."""
    try:
        return importlib.metadata.distribution("baton-client").files
    except importlib.metadata.PackageNotFoundError:
        return None


def test_two_prefixes_in_turn_and_a_wheel_name_no_build_dir_and_no_earlier_prefix(tmp_path):
    houses = ["--find-links", str(wheelhouse())]
    had_build = (PACKAGE / "build").exists()
    first, second, third = tmp_path / "first-prefix", tmp_path / "second-prefix", tmp_path / "wheel-prefix"
    wheels = tmp_path / "wheels"

    # --ignore-installed: without it pip "upgrades" the copy installed in
    # this venv, uninstalling it, and every later test that imports the
    # client fails (it did, in a full run of the suite).
    installed_here = installed_files()
    pip("install", *houses, "--ignore-installed", "--prefix", str(first), str(PACKAGE))
    check_tree(first, PACKAGE, [])
    check_import(first, tmp_path)

    pip("install", *houses, "--ignore-installed", "--prefix", str(second), str(PACKAGE))
    pip("wheel", *houses, "--no-deps", "-w", str(wheels), str(PACKAGE))
    [wheel] = wheels.glob("baton_client-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            data = archive.read(name)
            for needle in spellings(PACKAGE) | spellings(first) | spellings(second):
                if needle in data:
                    pytest.fail(f"{wheel.name}: {name} names {needle.decode()}")
    pip("install", "--no-deps", "--ignore-installed", "--prefix", str(third), str(wheel))
    assert installed_files() == installed_here, "the venv's own install changed"
    assert all(f.locate().exists() for f in installed_here or []), "the venv's own install was removed"

    # Each later install stands on its own once the first is gone.
    shutil.rmtree(first)
    check_tree(second, PACKAGE, [first])
    check_import(second, tmp_path)
    check_tree(third, wheel, [first, second])
    check_import(third, tmp_path)
    # The build happened outside the source tree.
    assert had_build or not (PACKAGE / "build").exists(), f"the install left {PACKAGE / 'build'} behind"
