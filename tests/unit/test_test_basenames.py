"""Every test file's name is unique across tests/: pytest imports them as top-level modules (rootdir conftest,
no packages), and two files of one name stop the whole run at collection ("import file mismatch"), which
happened twice when a unit test was named after the integration test of the same feature."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_files_share_a_name():
    where = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        where[path.name].append(str(path.relative_to(TESTS)))
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not shared, f"rename one of each (e.g. the unit test after what it checks): {shared}"
