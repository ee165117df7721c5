"""The tests stage: the `-m gpu` tests (but the slow ones unless `--tests-marker gpu`), judged by the rules of a GPU
run."""

from __future__ import annotations

from devtools.gpu_check.junit import junit_summary
from devtools.gpu_check.result import StageResult
from devtools.gpu_check.runner import Runner, python

OPTIONAL_SKIP = "optional package"  # the one skip reason a GPU run accepts (e.g. flash-attn not installed)


def stage_tests(run: Runner, args) -> None:
    r = run.result
    xml = run.log.with_suffix(".xml")
    xml.unlink(missing_ok=True)
    run.run(
        python()
        + ["-m", "pytest", "-m", args.tests_marker, "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", "tests"],
        check=False,
    )
    if not xml.is_file():
        r.fail("pytest wrote no report (see tests.log)")
        return
    judge_tests(r, junit_summary(xml))


def judge_tests(r: StageResult, s: dict) -> None:
    """On a GPU nothing may fail, and nothing may skip except for a missing optional package."""
    r.data = s
    r.columns = ["result", "count"]
    r.rows = [["passed", s["passed"]], ["failed", len(s["failed"])], ["skipped", len(s["skipped"])]]
    for f in s["failed"]:
        r.fail(f"FAILED {f['test']}: {f['message']}")
    for sk in s["skipped"]:
        if OPTIONAL_SKIP in sk["reason"]:
            r.notes.append(f"skipped {sk['test']}: {sk['reason']}")
        else:
            r.fail(f"skipped on a GPU {sk['test']}: {sk['reason']}")
    if s["passed"] == 0 and not s["failed"]:
        r.fail("no GPU test ran")
