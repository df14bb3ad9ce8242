"""Hugging Face: AmpGuardCallback, ``amp_runtime.guard()`` and ``python -m amp_runtime run``
around real ``Trainer.train`` runs on the CPU, on a tiny randomly initialised Llama body
(tests/frameworks/hf_train.py is the user's script; nothing is downloaded)."""
import os
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the test requirements install transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import amp_runtime  # noqa: E402
from amp_runtime.guard import active_guards  # noqa: E402
from amp_runtime.integrations.transformers import AmpGuardCallback  # noqa: E402
from frameworks import hf_train as user  # noqa: E402
from frameworks.support import (  # noqa: E402
    assert_overflow_pinned, events_in, line_of, place, rebuilt_report, run_script, torchrun,
)

SCRIPT = Path(user.__file__).resolve()
OVERFLOW = line_of(SCRIPT, "# injected overflow")
MODEL_CALL = line_of(SCRIPT, 'loss = model(**inputs)["loss"]')


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_healthy_train_is_silent_and_its_losses_unchanged(precision, tmp_path, capfd):
    unguarded = user.train(precision, output=tmp_path / "plain")
    callback = AmpGuardCallback(policy="raise")  # any event would stop training
    with_callback = user.train(precision, output=tmp_path / "callback", callbacks=[callback])
    with amp_runtime.guard(policy="raise") as guard:
        with_guard = user.train(precision, output=tmp_path / "guard")
    assert with_callback == with_guard == unguarded
    assert len(callback.guard.report) == len(guard.report) == 0
    log_dir = tmp_path / "callback" / "amp-report"  # in args.output_dir
    assert callback.session.log_dir == log_dir
    assert events_in(log_dir) == [] and (log_dir / "report.html").is_file()
    assert callback.guard.step_index == 6
    assert "amp_runtime" not in capfd.readouterr().err
    assert active_guards() == []


def test_under_amp_runtime_run_a_healthy_bf16_train_keeps_exit_status_and_losses(tmp_path):
    status, losses, output = run_script(SCRIPT, ["--output", tmp_path / "plain"], tmp_path)
    assert status == 0, output
    guarded = run_script(SCRIPT, ["--output", tmp_path / "guarded"], tmp_path,
                         guard_out=tmp_path / "amp")
    assert guarded[:2] == (0, losses), guarded[2]
    assert events_in(tmp_path / "amp") == []


def test_an_injected_overflow_is_pinned_to_the_users_model_code_at_the_trainers_step(tmp_path):
    callback = AmpGuardCallback(policy="record", trace="always")
    user.train(overflow_at=3, output=tmp_path, callbacks=[callback])
    events = callback.guard.report.events
    assert_overflow_pinned(events, SCRIPT, OVERFLOW, step=3)
    # backward runs in accelerate, the model's layers in transformers: details, not sources
    loss = next(e for e in events if e.code == "AMP112")
    assert "/accelerate/" in loss.details["library_source"]
    assert place(loss.source) == line_of(SCRIPT, "trainer.train(resume_from_checkpoint")
    assert [e.step for e in events_in(tmp_path / "amp-report")] == [e.step for e in events]


def test_an_overflow_inside_the_library_is_pinned_to_the_users_call_of_it(tmp_path):
    """The first op to overflow runs in transformers' Llama code: the source is the user's line
    that called the body, the library's line goes in details."""
    callback = AmpGuardCallback(policy="record", trace="always")
    user.train(overflow_at=3, output=tmp_path, callbacks=[callback], overflow_inside_body=True)
    (first, *_) = callback.guard.report.by_code("AMP101")
    assert first.step == 3 and first.module.startswith("body.")
    assert place(first.source) == line_of(SCRIPT, "hidden = self.body(")
    assert "/transformers/models/llama/" in first.details["library_source"]


def test_the_callback_honours_select_and_policy_and_leaves_the_guard_on_an_error(tmp_path):
    selected = AmpGuardCallback(policy="record", trace="always", select=["AMP112"])
    user.train(overflow_at=3, output=tmp_path / "select", callbacks=[selected])
    assert {e.code for e in selected.guard.report} == {"AMP112"}

    raising = AmpGuardCallback(policy="raise", trace="always", log_dir=tmp_path / "logs")
    with pytest.raises(amp_runtime.GuardError) as stopped:
        user.train(overflow_at=3, output=tmp_path / "raise", callbacks=[raising])
    assert (stopped.value.event.code, stopped.value.event.step) == ("AMP101", 3)
    assert active_guards() == []  # HF calls no callback on an error: the wrapped train() did
    assert (tmp_path / "logs" / "report.html").is_file()


def test_events_name_the_step_the_trainer_counts_on_a_resumed_train(tmp_path):
    user.train(steps=3, output=tmp_path, save_steps=3)
    callback = AmpGuardCallback(policy="record", trace="always", log_dir=False)
    user.train(steps=6, overflow_at=1, output=tmp_path, callbacks=[callback],
               resume=str(tmp_path / "checkpoint-3"))
    first = callback.guard.report.events[0]
    assert (first.code, first.step) == ("AMP101", 4)  # the guard itself counted 1
    assert callback.session.log_dir is None and not (tmp_path / "amp-report").exists()


def test_ddp_writes_a_folder_per_rank_and_one_report_naming_the_first_failing_rank(tmp_path):
    result = torchrun(SCRIPT, "--callback", "--overflow-at", 3, "--overflow-rank", 1,
                      "--output", tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    base = tmp_path / "out" / "amp-report"
    assert sorted(p.name for p in base.iterdir() if p.is_dir()) == ["rank-0", "rank-1"]
    failing = events_in(base / "rank-1")
    assert (failing[0].code, failing[0].step, failing[0].rank) == ("AMP112", 3, 1)
    assert {e.rank for e in events_in(base / "rank-0")} == {0}
    page = rebuilt_report(base)
    assert "First failing rank: rank 1 at step 3: AMP112 (P0) nonfinite-loss" in page
