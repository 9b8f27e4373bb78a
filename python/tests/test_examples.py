"""Every example runs as shown: the ```python blocks of python/README.md and docs/python.md,
and the scripts in python/examples/ (with the bus address as argument, and from
$LEANSTREAM_BUS alone)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PYTHON_DIR = Path(__file__).resolve().parent.parent
REPO = PYTHON_DIR.parent
DOCS = [PYTHON_DIR / "README.md", REPO / "docs" / "python.md"]
SCRIPTS = sorted((PYTHON_DIR / "examples").glob("*.py"))
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks():
    out = []
    for doc in DOCS:
        for i, code in enumerate(FENCE.findall(doc.read_text())):
            out.append(pytest.param(code, id=f"{doc.name}-{i}"))
    return out


def run(args, address, env_address=True):
    env = dict(os.environ)
    if not env_address:
        env.pop("LEANSTREAM_BUS", None)
    else:
        env["LEANSTREAM_BUS"] = address
    done = subprocess.run([sys.executable, *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip(), "the example printed nothing"
    return done.stdout


def test_there_are_examples():
    assert len(blocks()) >= 10 and len(SCRIPTS) >= 3
    assert (PYTHON_DIR / "examples" / "planner.py") in SCRIPTS


@pytest.mark.daemon
@pytest.mark.parametrize("code", blocks())
def test_doc_block_runs(code, address):
    run(["-c", code], address)


@pytest.mark.daemon
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_example_script_runs(script, address):
    run([str(script), address], address, env_address=False)


@pytest.mark.daemon
def test_planner_prints_a_valid_plan(address):
    out = run([str(PYTHON_DIR / "examples" / "planner.py")], address)
    plan = json.loads(out)
    assert plan["action"] in ("pick", "place") and isinstance(plan["object"], str)


def test_planner_fits_in_ten_lines():
    src = (PYTHON_DIR / "examples" / "planner.py").read_text()
    body = src.split('"""', 2)[2]  # after the docstring
    lines = [l for l in body.splitlines() if l.strip() and not l.lstrip().startswith("#")]
    assert len(lines) <= 10, lines
    # The README shows the same code.
    readme = (PYTHON_DIR / "README.md").read_text()
    assert body.strip() in readme
