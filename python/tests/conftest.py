"""Fixtures for the tests that need the real daemon.

scripts/test-python runs pytest under the serve example, which starts a private bus and the
real leanstreamd and sets LEANSTREAM_BUS and LEANSTREAM_MODEL. Without LEANSTREAM_BUS the daemon
tests are skipped (the wire tests still run), unless LEANSTREAM_REQUIRE_DAEMON=1 says a skip
would hide a failure.
"""

import os

import pytest

import leanstream


def pytest_collection_modifyitems(config, items):
    if os.environ.get("LEANSTREAM_BUS"):
        return
    if os.environ.get("LEANSTREAM_REQUIRE_DAEMON") == "1":
        raise pytest.UsageError("LEANSTREAM_REQUIRE_DAEMON=1 but LEANSTREAM_BUS is not set")
    skip = pytest.mark.skip(reason="needs a daemon: run scripts/test-python")
    for item in items:
        if "daemon" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    config.addinivalue_line("markers", "daemon: needs the real leanstreamd (LEANSTREAM_BUS)")


@pytest.fixture
def address():
    return os.environ["LEANSTREAM_BUS"]


@pytest.fixture
def model():
    return os.environ.get("LEANSTREAM_MODEL", "smollm2")


@pytest.fixture
def client(address):
    with leanstream.Client(address, timeout=120) as c:
        yield c
