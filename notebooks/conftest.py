"""The notebooks run in the slow tier of the tests (docs/development.md): ``pytest notebooks --nbmake -m slow``,
as CI does after README's test command; each is a real training or benchmark run of 15 s to 2 min here."""

import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.fspath).endswith(".ipynb") and os.path.dirname(str(item.fspath)) == HERE:
            item.add_marker(pytest.mark.slow)
