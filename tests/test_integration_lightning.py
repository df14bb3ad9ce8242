"""Lightning: AmpGuardCallback, ``amp_runtime.guard()`` and ``python -m amp_runtime run``
around real ``Trainer.fit`` runs on the CPU (tests/frameworks/lightning_train.py is the
user's script)."""
from pathlib import Path

import pytest

pytest.importorskip("lightning.pytorch", reason="the test requirements install lightning")

import amp_runtime  # noqa: E402
from amp_runtime.guard import active_guards  # noqa: E402
from amp_runtime.integrations.lightning import AmpGuardCallback  # noqa: E402
from frameworks import lightning_train as user  # noqa: E402
from frameworks.support import (  # noqa: E402
    assert_overflow_pinned, assert_sources_are_users, events_in, line_of, place, rebuilt_report,
    run_script,
)

SCRIPT = Path(user.__file__).resolve()
#: "16-mixed" falls back to bf16 on a CPU; SCALER is fp16 with a CPU GradScaler.
PRECISIONS = ("bf16-mixed", "16-mixed", user.SCALER)
OVERFLOW = line_of(SCRIPT, "# injected overflow")
FIT_CALL = line_of(SCRIPT, ".fit(model, batches())")


@pytest.fixture(scope="module")
def unguarded_losses(tmp_path_factory):
    losses = {}

    def of(precision):
        if precision not in losses:
            losses[precision] = user.fit(precision, root=tmp_path_factory.mktemp("plain"))
        return losses[precision]

    return of


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_healthy_fit_is_silent_and_its_losses_unchanged(
        precision, unguarded_losses, tmp_path, capfd):
    callback = AmpGuardCallback(policy="raise")  # any event would stop the fit
    with_callback = user.fit(precision, root=tmp_path / "callback", callbacks=[callback])
    with amp_runtime.guard(policy="raise") as guard:
        with_guard = user.fit(precision, root=tmp_path / "guard")
    assert with_callback == with_guard == unguarded_losses(precision)
    assert len(callback.guard.report) == len(guard.report) == 0
    # the logs go to the trainer's folder (default_root_dir: the script has no logger)
    log_dir = tmp_path / "callback" / "amp-report"
    assert callback.session.log_dir == log_dir
    assert events_in(log_dir) == []
    steps = [line.split(",")[0] for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [f'{{"step": {n}' for n in range(6)]
    assert (log_dir / "report.html").is_file()
    assert "amp_runtime" not in capfd.readouterr().err
    assert active_guards() == []


@pytest.mark.parametrize("precision", PRECISIONS)
def test_under_amp_runtime_run_a_healthy_fit_keeps_exit_status_and_losses(precision, tmp_path):
    status, losses, output = run_script(SCRIPT, ["--precision", precision], tmp_path)
    assert status == 0, output
    guarded = run_script(SCRIPT, ["--precision", precision], tmp_path, guard_out=tmp_path / "amp")
    assert guarded[:2] == (0, losses), guarded[2]
    assert events_in(tmp_path / "amp") == []
    assert "amp_runtime: no events" in guarded[2]


@pytest.mark.parametrize("precision", ["bf16-mixed", user.SCALER])
def test_an_injected_overflow_is_pinned_to_the_users_line_at_the_trainers_step(precision,
                                                                               tmp_path):
    callback = AmpGuardCallback(policy="record", trace="always")
    user.fit(precision, overflow_at=3, root=tmp_path, callbacks=[callback])
    events = callback.guard.report.events
    assert_overflow_pinned(events, SCRIPT, OVERFLOW, step=3)
    # the step-level checks run inside Lightning's precision plugin: its line is a detail
    loss = next(e for e in events if e.code == "AMP112")
    assert (loss.step, place(loss.source)) == (3, FIT_CALL)
    assert "/lightning/" in loss.details["library_source"]


def test_by_default_the_overflow_is_found_at_its_step_by_the_loss_check(tmp_path):
    callback = AmpGuardCallback(policy="record")  # trace="auto"
    user.fit("bf16-mixed", overflow_at=3, root=tmp_path, callbacks=[callback])
    events = callback.guard.report.events
    assert (events[0].code, events[0].step, place(events[0].source)) == ("AMP112", 3, FIT_CALL)
    assert_sources_are_users(events, SCRIPT)
    assert [e.step for e in events_in(tmp_path / "amp-report")] == [e.step for e in events]


def test_the_callback_honours_select_ignore_trace_and_policy(tmp_path):
    selected = AmpGuardCallback(policy="record", trace="always", select=["AMP101"])
    user.fit("bf16-mixed", overflow_at=3, root=tmp_path / "select", callbacks=[selected])
    assert {e.code for e in selected.guard.report} == {"AMP101"}

    ignored = AmpGuardCallback(policy="record", trace="always", ignore=["AMP101", "AMP112"])
    user.fit("bf16-mixed", overflow_at=3, root=tmp_path / "ignore", callbacks=[ignored])
    codes = {e.code for e in ignored.guard.report}
    assert codes and not codes & {"AMP101", "AMP112"}

    untraced = AmpGuardCallback(policy="record", trace="off")
    user.fit("bf16-mixed", overflow_at=3, root=tmp_path / "off", callbacks=[untraced])
    assert "AMP112" in {e.code for e in untraced.guard.report}
    assert "AMP101" not in {e.code for e in untraced.guard.report}

    raising = AmpGuardCallback(policy="raise", trace="always")
    with pytest.raises(amp_runtime.GuardError) as stopped:
        user.fit("bf16-mixed", overflow_at=3, root=tmp_path / "raise", callbacks=[raising])
    assert (stopped.value.event.code, stopped.value.event.step) == ("AMP101", 3)
    assert active_guards() == []  # left on the exception (Lightning's on_exception)
    assert (tmp_path / "raise" / "amp-report" / "report.html").is_file()


def test_bad_options_fail_where_the_callback_is_made():
    with pytest.raises(ValueError, match="policy"):
        AmpGuardCallback(policy="loud")
    with pytest.raises(ValueError, match="AMP9"):
        AmpGuardCallback(select=["AMP9"])
    with pytest.raises(TypeError, match="log_dir"):
        AmpGuardCallback(log_dir=3)


def test_events_name_the_step_the_trainer_counts_on_a_resumed_fit(tmp_path):
    first = user.trainer(steps=4, root=tmp_path)
    first.fit(user.Regressor(), user.batches())
    first.save_checkpoint(tmp_path / "four.ckpt")
    callback = AmpGuardCallback(policy="record", trace="always", log_dir=tmp_path / "logs")
    resumed = user.trainer(steps=8, root=tmp_path, callbacks=[callback])
    resumed.fit(user.Regressor(overflow_at=6), user.batches(), ckpt_path=tmp_path / "four.ckpt")
    events = callback.guard.report.events
    assert (events[0].code, events[0].step) == ("AMP101", 6)  # the guard itself counted 2
    assert callback.session.log_dir == tmp_path / "logs"


def test_ddp_writes_a_folder_per_rank_and_one_report_naming_the_first_failing_rank(tmp_path):
    root = tmp_path / "ddp"
    status, _, output = run_script(
        SCRIPT, ["--devices", 2, "--callback", "--overflow-at", 3, "--overflow-rank", 1,
                 "--root", root], tmp_path)
    assert status == 0, output
    base = root / "amp-report"
    assert sorted(p.name for p in base.iterdir() if p.is_dir()) == ["rank-0", "rank-1"]
    failing = events_in(base / "rank-1")
    assert (failing[0].code, failing[0].step, failing[0].rank) == ("AMP112", 3, 1)
    assert_sources_are_users(failing, SCRIPT)
    assert {e.rank for e in events_in(base / "rank-0")} == {0}  # its gradients, all-reduced
    page = rebuilt_report(base)
    assert "First failing rank: rank 1 at step 3: AMP112 (P0) nonfinite-loss" in page
    assert 'id="rank-0-plot-loss"' in page and 'id="rank-1-plot-loss"' in page


def test_the_pytorch_lightning_package_name_has_its_own_callback(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from amp_runtime.integrations.pytorch_lightning import AmpGuardCallback as Callback

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = user.Regressor().net

        def training_step(self, batch, batch_idx):
            x, y = batch
            return (self.net(x).float() - y).pow(2).mean()

        def configure_optimizers(self):
            return user.torch.optim.SGD(self.parameters(), lr=0.05)

    callback = Callback(policy="raise")
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, precision="bf16-mixed", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         default_root_dir=tmp_path, callbacks=[callback])
    trainer.fit(Tiny(), user.batches())
    assert callback.guard.step_index == 3 and len(callback.guard.report) == 0
