"""The tier table (tests/conftest.py's TIERS) covers every test file and names only tests that exist;
every collected test carries exactly one tier marker."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import TIER_NAMES, TIERS

HERE = Path(__file__).resolve().parent


def test_every_test_file_has_a_tier_and_every_entry_a_file():
    files = {p.name for p in HERE.glob("test_*.py")}
    assert sorted(files - set(TIERS)) == [], "test files missing from conftest.TIERS"
    assert sorted(set(TIERS) - files) == [], "conftest.TIERS names files that are gone"


def test_the_tiers_and_exceptions_name_real_tiers_and_tests():
    for name, entry in TIERS.items():
        default, exceptions = (entry, {}) if isinstance(entry, str) else entry
        assert default in TIER_NAMES, name
        source = (HERE / name).read_text()
        for test, tier in exceptions.items():
            assert tier in TIER_NAMES and tier != default, (name, test, tier)
            assert re.search(rf"^def {re.escape(test)}\(", source, re.M), f"{name} has no test {test}"


def test_each_collected_test_has_exactly_one_tier(request):
    for item in request.session.items:
        tiers = {m.name for m in item.iter_markers() if m.name in TIER_NAMES}
        assert len(tiers) == 1, (item.nodeid, tiers)
