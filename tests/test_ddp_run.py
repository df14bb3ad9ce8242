"""``python -m amp_runtime run`` under torchrun: a real 2-process gloo group on the CPU writes
one log folder per rank, and ``python -m amp_runtime report`` over them gives one page that
names the first failing rank and step."""
from pathlib import Path

import amp_runtime
from frameworks.support import line_of, place, rebuilt_report, torchrun

SCRIPT = Path(__file__).resolve().parent / "frameworks" / "ddp_train.py"


def test_each_rank_writes_its_own_folder_and_the_report_names_the_first_failing_rank(tmp_path):
    out = tmp_path / "amp-report"
    result = torchrun("-m", "amp_runtime", "run", "--policy", "record", "--out", out, SCRIPT,
                      "--overflow-at", 3, "--overflow-rank", 1, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["rank-0", "rank-1"]
    rank1 = amp_runtime.Report.from_jsonl(out / "rank-1" / "events.jsonl").events
    first = rank1[0]
    assert (first.code, first.step, first.rank) == ("AMP112", 3, 1)
    assert place(first.source) == line_of(SCRIPT, "loss.backward()")
    rank0 = amp_runtime.Report.from_jsonl(out / "rank-0" / "events.jsonl").events
    assert {e.rank for e in rank0} == {0}
    assert all(e.step >= 3 for e in rank0)  # rank 0 got the NaN through the all-reduce

    page = rebuilt_report(out)
    assert "First failing rank: rank 1 at step 3: AMP112 (P0) nonfinite-loss" in page
    assert '<section id="rank-0">' in page and '<section id="rank-1">' in page


def test_a_healthy_ddp_run_keeps_its_losses_and_has_no_event(tmp_path):
    plain = torchrun(SCRIPT, "--losses", tmp_path / "plain.json", cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr[-4000:]
    guarded = torchrun("-m", "amp_runtime", "run", "--out", tmp_path / "amp", SCRIPT,
                       "--losses", tmp_path / "guarded.json", cwd=tmp_path)
    assert guarded.returncode == 0, guarded.stderr[-4000:]
    assert (tmp_path / "plain.json").read_text() == (tmp_path / "guarded.json").read_text()
    for rank in (0, 1):
        assert (tmp_path / "amp" / f"rank-{rank}" / "events.jsonl").read_text() == ""
