"""The hardening scripts' arithmetic and reports, without a cluster: the soak's memory slope
and summary, and the fault and fuzz reports' tables."""

from collections import Counter

from specserve.benchmarks import faults, fuzz, soak


def test_memory_slope_is_least_squares_in_mb_per_minute():
    assert soak.slope_mb_per_min([(0, 100.0), (60, 102.0), (120, 104.0)]) == 2.0
    assert soak.slope_mb_per_min([(0, 100.0), (60, 100.0), (120, 100.0)]) == 0.0
    assert soak.slope_mb_per_min([(0, 100.0), (60, 102.0)]) is None  # too few points to say


def test_memory_summary_skips_the_warm_up():
    samples = [soak.Sample(t, {"TargetPool r1": 500.0 + (50 if t < 60 else 0) + t / 60}, {"TargetPool": 0})
               for t in range(0, 301, 30)]
    summary = soak.memory_summary(samples, warmup_s=60)["TargetPool r1"]
    assert summary["start_mb"] == 550.0 and summary["end_mb"] == 505.0
    assert summary["steady_start_mb"] == 501.0 and summary["slope_mb_per_min"] == 1.0


def test_soak_report_names_leaks_and_failures():
    report = {"config": {"command": "python -m specserve.benchmarks.soak --minutes 3", "streams": 8, "minutes": 3,
                         "preset": "smol", "max_tokens": 64, "sample_s": 10},
              "load": {"completed": 10, "failed": 1, "tokens": 640, "errors": ["HTTP 500: b''"]},
              "tokens_per_s": 3.5, "leaked_caches": 2,
              "memory": {"TargetPool r1": {"start_mb": 1, "steady_start_mb": 2, "end_mb": 3, "slope_mb_per_min": 0.1}}}
    text = soak.markdown(report)
    assert "completed: 10, failed: 1" in text and "end: 2 (goal 0)" in text and "HTTP 500" in text


def test_fault_report_sums_runs_per_kind():
    runs = [faults.FaultRun("draft", 4, completed=4, exact=4, after_ok=4, after_sent=4, recovered_s=3.0, cached_after=0),
            faults.FaultRun("router", 4, completed=3, exact=3, resumed=2, failed=1, after_ok=4, after_sent=4,
                            recovered_s=5.5, cached_after=0, errors=["ended without [DONE] after 3 chunks"])]
    text = faults.markdown(runs, {"command": "faults", "streams": 4, "max_tokens": 32, "rounds": 1, "model": "m",
                                  "seconds": 10, "resumes": 1})
    assert "| draft | 1 | 4 | 4 | 4 | 0 | 0 | 0 | 0 | 4/4 | 3.0 | 0 |" in text
    assert "| router | 1 | 4 | 3 | 3 | 2 | 1 | 0 | 0 | 4/4 | 5.5 | 0 |" in text and "without [DONE]" in text
    assert "resume a broken stream up to 1 time(s)" in text


def test_fuzz_report_counts_failures():
    tally = fuzz.Tally("grpc", sent=3, statuses=Counter({"OK": 1, "INVALID_ARGUMENT": 1, "INTERNAL": 1}),
                       server_errors=["Generate INTERNAL 'boom': model: \"smol\""])
    assert tally.failed == 1
    text = fuzz.markdown([tally], {"command": "fuzz", "minutes": 1, "timeout_s": 60})
    assert "| grpc | 3 | 1 | 0 |" in text and "boom" in text
