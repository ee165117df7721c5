"""Reading pytest's JUnit XML report."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path


def junit_summary(xml_path: Path) -> dict:
    """Counts, failures and skips (with reasons) from a pytest JUnit XML file."""
    root = ET.parse(xml_path).getroot()
    cases = root.iter("testcase")
    out = {"passed": 0, "failed": [], "skipped": []}
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            out["failed"].append({"test": name, "message": (bad.get("message") or "")[:300]})
        elif skip is not None:
            out["skipped"].append({"test": name, "reason": skip.get("message") or ""})
        else:
            out["passed"] += 1
    return out
