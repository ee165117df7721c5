"""`logging.profile`'s choice of steps, its refusals, and the kernel tables (the trace of a real run:
test_train_report.py)."""

from types import SimpleNamespace

import pytest
import torch

from lctrain.config import load_config
from lctrain.errors import UserError
from lctrain.profiling import ProfiledSteps, StepProfiler, top_kernels
from lctrain.train.report import profile_line


@pytest.mark.parametrize(
    "start, steps, total, resumed_at, expected",
    [
        (None, 2, 10, 0, None),
        (1, 2, 10, 0, (0, 1, 0)),  # the first step has no step before it to warm up on
        (5, 2, 10, 0, (4, 5, 1)),
        (9, 5, 10, 0, (8, 9, 1)),  # cut at the run's end
        (5, 3, 10, 5, (5, 6, 0)),  # resumed inside the window: what is left of it, no warm-up step
        (5, 3, 10, 4, (4, 6, 0)),  # resumed at the window's first step
        (5, 2, 10, 7, None),  # resumed after it
    ],
)
def test_profiled_steps(start, steps, total, resumed_at, expected):
    got = ProfiledSteps.of(start, steps, total, resumed_at)
    assert (None if got is None else (got.first, got.last, got.warmup)) == expected


def test_the_window_is_named_by_its_steps_as_metrics_numbers_them():
    assert ProfiledSteps.of(5, 2, 10, 0).name == "steps_5-6"


@pytest.mark.parametrize(
    "items, message",
    [
        (["train.steps=4", "logging.profile.start=5"], "logging.profile.start 5 is after the run's last step"),
        (["logging.profile.start=0"], "logging.profile.start"),
        (["logging.profile.steps=0"], "logging.profile.steps"),
        (["logging.profile.ranks=[]"], "logging.profile.ranks"),
        (["logging.profile.ranks=[1]"], "logging.profile.ranks [1]: the run has ranks 0-0"),
        (["logging.profile.ranks=some"], "logging.profile.ranks"),
    ],
)
def test_a_profile_outside_the_run_is_refused(items, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, items)


def test_ranks_all_and_a_list_within_the_world_are_accepted():
    assert load_config(None, ["logging.profile.ranks=all"]).logging.profile.ranks == "all"
    two = load_config(None, ["parallel.nproc_per_node=2", "logging.profile.ranks=[1]"])
    assert two.logging.profile.ranks == [1]


def test_top_kernels_orders_by_self_time_of_the_device():
    events = [
        SimpleNamespace(key="a", count=2, self_cpu_time_total=5000.0, self_device_time_total=0.0),
        SimpleNamespace(key="b", count=1, self_cpu_time_total=1000.0, self_device_time_total=9000.0),
        SimpleNamespace(key="c", count=3, self_cpu_time_total=0.0, self_device_time_total=3000.0),
    ]
    assert top_kernels(events, 5, "cpu") == [
        {"name": "a", "count": 2, "total_ms": 5.0, "share": 5 / 6},
        {"name": "b", "count": 1, "total_ms": 1.0, "share": 1 / 6},
    ]
    assert [(k["name"], k["share"]) for k in top_kernels(events, 1, "cuda")] == [("b", 0.75)]


def test_the_log_line_names_the_directory_the_ranks_and_the_top_operators(tmp_path):
    where = tmp_path / "steps_3-4"
    top = [{"name": "aten::mm", "share": 0.514}, {"name": "aten::bmm", "share": 0.2}]
    assert profile_line(where, [0], top) == (
        f"profile of 3-4: {where}/ (rank 0; Chrome traces for ui.perfetto.dev); most self time: aten::mm 51%, "
        f"aten::bmm 20%"
    )
    assert (
        profile_line(where, [2, 5], []) == f"profile of 3-4: {where}/ (ranks 2, 5; Chrome traces for ui.perfetto.dev)"
    )
    assert "(every rank;" in profile_line(where, "all", [])


def test_a_profile_cut_short_by_a_failure_writes_nothing(tmp_path):
    profiler = StepProfiler(ProfiledSteps.of(1, 3, 10, 0), tmp_path, writes=True, rank=0, device="cpu", memory=False)
    profiler.before(0)
    torch.ones(4).sum()
    profiler.after(0)
    profiler.close()  # the run failed in step 2 of 3
    assert profiler.written is None and not any(tmp_path.iterdir())


def test_a_rank_that_writes_no_trace_still_knows_the_profiled_steps(tmp_path):
    profiler = StepProfiler(ProfiledSteps.of(2, 1, 10, 0), tmp_path, writes=False, rank=1, device="cpu", memory=False)
    for i in range(3):
        profiler.before(i)
        profiler.after(i)
    profiler.close()
    assert [profiler.slowed(i) for i in range(3)] == [True, True, False] and profiler.finished(1)  # 0: warm-up
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("start", [1, 2, 4])
def test_the_trace_holds_exactly_the_chosen_steps(tmp_path, start):
    import gzip
    import json
    import warnings

    profiler = StepProfiler(ProfiledSteps.of(start, 2, 5, 0), tmp_path, writes=True, rank=0, device="cpu", memory=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns of a schedule without warm-up, or of a repeating one
        for i in range(5):
            profiler.before(i)
            with torch.profiler.record_function(f"step{i}"):
                torch.ones(8).sum()
            profiler.after(i)
        profiler.close()
    assert profiler.written == tmp_path / f"steps_{start}-{start + 1}"
    events = json.loads(gzip.decompress((profiler.written / "rank0.pt.trace.json.gz").read_bytes()))["traceEvents"]
    assert sorted({e["name"] for e in events if e.get("name", "").startswith("step")}) == [
        f"step{start - 1}",
        f"step{start}",
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_trace_has_the_kernels_and_memory_the_allocator_history(tmp_path):
    import gzip
    import json
    import pickle

    profiler = StepProfiler(ProfiledSteps.of(2, 1, 3, 0), tmp_path, writes=True, rank=0, device="cuda", memory=True)
    for i in range(3):
        profiler.before(i)
        x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
        (x @ x).sum().backward()
        torch.cuda.synchronize()
        profiler.after(i)
    profiler.close()
    out = profiler.written
    assert sorted(p.name for p in out.iterdir()) == ["rank0.memory.pickle", "rank0.pt.trace.json.gz", "rank0.top.txt"]
    snapshot = pickle.loads((out / "rank0.memory.pickle").read_bytes())
    assert snapshot["device_traces"] and any(snapshot["device_traces"])  # the allocations of the recorded steps
    events = json.loads(gzip.decompress((out / "rank0.pt.trace.json.gz").read_bytes()))["traceEvents"]
    kernels = {e["name"] for e in events if e.get("cat") == "kernel"}
    assert kernels and profiler.top and all(k["total_ms"] > 0 for k in profiler.top)  # ranked by device time


def test_an_unwritable_profile_directory_is_one_line(tmp_path):
    from lctrain.errors import WriteFailed

    blocked = tmp_path / "profile"
    blocked.write_text("a file where the directory goes")
    profiler = StepProfiler(ProfiledSteps.of(1, 1, 2, 0), blocked, writes=True, rank=0, device="cpu", memory=False)
    profiler.before(0)
    torch.ones(4).sum()
    with pytest.raises(WriteFailed, match="the profile"):
        profiler.after(0)
