"""``python -m flake8_amp fix`` on every fix shape and on the look-alikes it must leave alone.

Each case is a real file. One ``fix --write`` run rewrites the whole folder; then each
file must read exactly as its case says (unchanged for look-alikes), compile, lint clean
for the fixed code under real flake8 (look-alikes that the linter reports still are), and a
second run must find nothing to fix.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, NamedTuple, Optional

import pytest


class Case(NamedTuple):
    code: str
    before: str
    #: The file after the fix; None: it must stay byte for byte as it was.
    after: Optional[str] = None
    #: For a look-alike: does the linter report it (the fixer declines), or not at all?
    reported: bool = False


def case(code, before, after=None, reported=False) -> Case:
    dedent = textwrap.dedent
    return Case(code, dedent(before), dedent(after) if after is not None else None, reported)


CASES: Dict[str, Case] = {
    # ------------------------------------------------------------------ AMP009 fixes
    "amp009_scaler_and_autocast_calls": case(
        "AMP009",
        """\
        import torch


        def train(model, loader, optimizer):
            scaler = torch.cuda.amp.GradScaler()
            for x in loader:
                with torch.cuda.amp.autocast():
                    loss = model(x)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
        """,
        """\
        import torch


        def train(model, loader, optimizer):
            scaler = torch.amp.GradScaler("cuda")
            for x in loader:
                with torch.amp.autocast("cuda"):
                    loss = model(x)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
        """,
    ),
    "amp009_positional_arguments_keep_their_meaning": case(
        "AMP009",
        """\
        import torch

        scaler = torch.cuda.amp.GradScaler(1024.0, 2.0, enabled=True)
        ctx = torch.cuda.amp.autocast(True, torch.float16, False)
        cpu_ctx = torch.cpu.amp.autocast(False, dtype=torch.bfloat16)
        """,
        """\
        import torch

        scaler = torch.amp.GradScaler("cuda", 1024.0, 2.0, enabled=True)
        ctx = torch.amp.autocast("cuda", enabled=True, dtype=torch.float16, cache_enabled=False)
        cpu_ctx = torch.amp.autocast("cpu", enabled=False, dtype=torch.bfloat16)
        """,
    ),
    "amp009_multiline_call_keeps_layout_and_comments": case(
        "AMP009",
        """\
        import torch as th


        def forward(model, x):
            with th.cuda.amp.autocast(
                True,  # on for training
                dtype=th.bfloat16,
            ):
                return model(x)
        """,
        """\
        import torch as th


        def forward(model, x):
            with th.amp.autocast(
                "cuda",
                enabled=True,  # on for training
                dtype=th.bfloat16,
            ):
                return model(x)
        """,
    ),
    "amp009_imported_names_move_to_torch_amp": case(
        "AMP009",
        """\
        from torch.cuda.amp import GradScaler, autocast as ac


        def train(model, x):
            scaler = GradScaler(enabled=True)
            with ac(dtype=None):
                return scaler, model(x)
        """,
        """\
        from torch.amp import GradScaler, autocast as ac


        def train(model, x):
            scaler = GradScaler("cuda", enabled=True)
            with ac("cuda", dtype=None):
                return scaler, model(x)
        """,
    ),
    "amp009_module_aliases": case(
        "AMP009",
        """\
        import torch.cuda.amp as cuda_amp
        from torch.cuda import amp


        def train(model, x):
            scaler = amp.GradScaler()
            with cuda_amp.autocast():
                return scaler, model(x)
        """,
        """\
        import torch.amp as cuda_amp
        from torch import amp


        def train(model, x):
            scaler = amp.GradScaler("cuda")
            with cuda_amp.autocast("cuda"):
                return scaler, model(x)
        """,
    ),
    "amp009_decorators": case(
        "AMP009",
        """\
        import torch
        from torch.cuda.amp import custom_bwd


        @torch.cuda.amp.autocast()
        def forward(model, x):
            return model(x)


        class Scale(torch.autograd.Function):
            @staticmethod
            @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)
            def forward(ctx, x):
                return x * 2

            @staticmethod
            @custom_bwd  # gradients in the forward's dtype
            def backward(ctx, grad):
                return grad * 2
        """,
        """\
        import torch
        from torch.amp import custom_bwd


        @torch.amp.autocast("cuda")
        def forward(model, x):
            return model(x)


        class Scale(torch.autograd.Function):
            @staticmethod
            @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
            def forward(ctx, x):
                return x * 2

            @staticmethod
            @custom_bwd(device_type="cuda")  # gradients in the forward's dtype
            def backward(ctx, grad):
                return grad * 2
        """,
    ),
    # ------------------------------------------------------------- AMP009 look-alikes
    "amp009_version_gated_fallbacks": case(
        "AMP009",
        """\
        import torch


        def make_scaler():
            try:
                return torch.amp.GradScaler("cuda")
            except (AttributeError, TypeError):
                return torch.cuda.amp.GradScaler()


        def make_autocast(torch_ge_2_4):
            if torch_ge_2_4:
                return torch.amp.autocast("cuda")
            return torch.cuda.amp.autocast()
        """,
    ),
    "amp009_docstrings_and_strings": case(
        "AMP009",
        '''\
        import torch


        def make_scaler():
            """Replaces torch.cuda.amp.GradScaler() with torch.amp.GradScaler("cuda")."""
            message = "torch.cuda.amp.autocast is deprecated"
            return torch.amp.GradScaler("cuda"), message
        ''',
    ),
    "amp009_noqa_is_respected": case(
        "AMP009",
        """\
        import torch

        scaler = torch.cuda.amp.GradScaler(  # noqa: AMP009 kept for torch 1.x users
            enabled=True,
        )
        """,
    ),
    "amp009_aliases_and_partials_are_left_alone": case(
        "AMP009",
        """\
        import functools

        import torch

        make_scaler = torch.cuda.amp.GradScaler
        half_ctx = functools.partial(torch.cuda.amp.autocast, dtype=torch.float16)
        """,
        reported=True,
    ),
    "amp009_import_with_an_unfixable_use_is_left_alone": case(
        "AMP009",
        """\
        from torch.cuda.amp import GradScaler


        def make(existing):
            if isinstance(existing, GradScaler):
                return existing
            return GradScaler()
        """,
        reported=True,
    ),
    "amp009_args_spread_into_autocast": case(
        "AMP009",
        """\
        import torch


        def forward(model, x, settings):
            with torch.cuda.amp.autocast(*settings):
                return model(x)
        """,
        reported=True,
    ),
    # ------------------------------------------------------------------ AMP007 fixes
    "amp007_fills_on_named_tensors": case(
        "AMP007",
        """\
        import torch
        from torch import nn


        class Attention(nn.Module):
            def forward(self, q, k, mask):
                scores = q @ k.transpose(-2, -1)
                scores = scores.masked_fill(mask == 0, -1e9)  # padding
                scores.masked_fill_(mask=mask, value=-1e8)
                self.bias.fill_(-1e10)
                scores[mask] = -1e9
                top = torch.where(mask, scores, -1e9)
                floor = scores.new_full(scores.shape, 1e5)
                return scores.softmax(-1), top, floor
        """,
        """\
        import torch
        from torch import nn


        class Attention(nn.Module):
            def forward(self, q, k, mask):
                scores = q @ k.transpose(-2, -1)
                scores = scores.masked_fill(mask == 0, torch.finfo(scores.dtype).min)  # padding
                scores.masked_fill_(mask=mask, value=torch.finfo(scores.dtype).min)
                self.bias.fill_(torch.finfo(self.bias.dtype).min)
                scores[mask] = torch.finfo(scores.dtype).min
                top = torch.where(mask, scores, torch.finfo(scores.dtype).min)
                floor = scores.new_full(scores.shape, torch.finfo(scores.dtype).max)
                return scores.softmax(-1), top, floor
        """,
    ),
    "amp007_torch_alias_dtype_and_written_floats": case(
        "AMP007",
        """\
        import torch as th


        def masked(scores, mask, n):
            with th.autocast("cuda", dtype=th.float16):
                filler = th.full((n, n), -1e9, dtype=scores.dtype)
                a = scores.masked_fill(mask, float("-1e9"))
                b = scores.masked_fill(mask, th.finfo(th.float32).min)
                return filler, a, b
        """,
        """\
        import torch as th


        def masked(scores, mask, n):
            with th.autocast("cuda", dtype=th.float16):
                filler = th.full((n, n), th.finfo(scores.dtype).min, dtype=scores.dtype)
                a = scores.masked_fill(mask, th.finfo(scores.dtype).min)
                b = scores.masked_fill(mask, th.finfo(scores.dtype).min)
                return filler, a, b
        """,
    ),
    # ------------------------------------------------------------- AMP007 look-alikes
    "amp007_unknown_tensor_expression": case(
        "AMP007",
        """\
        import torch
        from torch import nn


        class Head(nn.Module):
            def forward(self, x, mask):
                return self.proj(x).masked_fill(mask, -1e9)
        """,
        reported=True,
    ),
    "amp007_constant_defined_elsewhere_and_integers": case(
        "AMP007",
        """\
        import torch
        from torch import nn

        NEG_INF = -1e9


        class Head(nn.Module):
            def forward(self, scores, mask):
                scores = scores.masked_fill(mask, NEG_INF)
                return scores.masked_fill(~mask, -100000)
        """,
        reported=True,
    ),
    "amp007_no_torch_module_name": case(
        "AMP007",
        """\
        from torch import nn


        class Head(nn.Module):
            def forward(self, scores, mask):
                return scores.masked_fill(mask, -1e9)
        """,
        reported=True,
    ),
    "amp007_safe_values_are_not_findings": case(
        "AMP007",
        """\
        import torch
        from torch import nn


        class Head(nn.Module):
            def forward(self, scores, mask):
                big = -1e9 if scores.dtype == torch.float32 else -1e4
                scores = scores.masked_fill(mask, big)
                return scores.masked_fill(~mask, torch.finfo(scores.dtype).min)


        best_loss = 1e9
        """,
    ),
    # ------------------------------------------------------------------ AMP005 fixes
    "amp005_unscale_before_the_clip": case(
        "AMP005",
        """\
        import torch


        def train(model, loader, optimizer):
            scaler = torch.amp.GradScaler("cuda")
            for x, y in loader:
                with torch.autocast("cuda"):
                    loss = model(x, y)
                scaler.scale(loss).backward()

                # keep the update small
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                torch.nn.utils.clip_grad_value_(model.parameters(), 5.0)
                scaler.step(optimizer)
                scaler.update()
            return norm
        """,
        """\
        import torch


        def train(model, loader, optimizer):
            scaler = torch.amp.GradScaler("cuda")
            for x, y in loader:
                with torch.autocast("cuda"):
                    loss = model(x, y)
                scaler.scale(loss).backward()

                # keep the update small
                scaler.unscale_(optimizer)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                torch.nn.utils.clip_grad_value_(model.parameters(), 5.0)
                scaler.step(optimizer)
                scaler.update()
            return norm
        """,
    ),
    "amp005_attributes_and_nested_blocks": case(
        "AMP005",
        """\
        import torch
        from torch.nn.utils import clip_grad_norm_


        class Trainer:
            def __init__(self, model, optimizer, max_norm):
                self.model, self.optimizer, self.max_norm = model, optimizer, max_norm
                self.scaler = torch.amp.GradScaler("cuda")

            def step(self, loader, accumulation):
                for index, batch in enumerate(loader):
                    with torch.autocast("cuda"):
                        loss = self.model(batch) / accumulation
                    self.scaler.scale(loss).backward()
                    if (index + 1) % accumulation == 0:
                        if self.max_norm:
                            clip_grad_norm_(self.model.parameters(), self.max_norm)
                        self.scaler.step(self.optimizer)
                        self.scaler.update()
        """,
        """\
        import torch
        from torch.nn.utils import clip_grad_norm_


        class Trainer:
            def __init__(self, model, optimizer, max_norm):
                self.model, self.optimizer, self.max_norm = model, optimizer, max_norm
                self.scaler = torch.amp.GradScaler("cuda")

            def step(self, loader, accumulation):
                for index, batch in enumerate(loader):
                    with torch.autocast("cuda"):
                        loss = self.model(batch) / accumulation
                    self.scaler.scale(loss).backward()
                    if (index + 1) % accumulation == 0:
                        if self.max_norm:
                            self.scaler.unscale_(self.optimizer)
                            clip_grad_norm_(self.model.parameters(), self.max_norm)
                        self.scaler.step(self.optimizer)
                        self.scaler.update()
        """,
    ),
    "amp005_clip_in_a_helper_and_fsdp": case(
        "AMP005",
        """\
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


        class Trainer:
            def __init__(self, model, optimizer):
                self.model, self.optimizer = model, optimizer
                self.scaler = torch.amp.GradScaler("cuda")

            def _clip_grads(self):
                return torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)

            def train_step(self, batch):
                with torch.autocast("cuda"):
                    loss = self.model(batch)
                self.scaler.scale(loss).backward()
                grad_norm = self._clip_grads()
                self.scaler.step(self.optimizer)
                self.scaler.update()
                return grad_norm


        def sharded_step(module, batch, optimizer, scaler):
            model = FSDP(module)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(batch)
            scaler.scale(loss).backward()
            model.clip_grad_norm_(1.0)
            scaler.step(optimizer)
            scaler.update()
        """,
        """\
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


        class Trainer:
            def __init__(self, model, optimizer):
                self.model, self.optimizer = model, optimizer
                self.scaler = torch.amp.GradScaler("cuda")

            def _clip_grads(self):
                return torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)

            def train_step(self, batch):
                with torch.autocast("cuda"):
                    loss = self.model(batch)
                self.scaler.scale(loss).backward()
                self.scaler.unscale_(self.optimizer)
                grad_norm = self._clip_grads()
                self.scaler.step(self.optimizer)
                self.scaler.update()
                return grad_norm


        def sharded_step(module, batch, optimizer, scaler):
            model = FSDP(module)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(batch)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            model.clip_grad_norm_(1.0)
            scaler.step(optimizer)
            scaler.update()
        """,
    ),
    # ------------------------------------------------------------- AMP005 look-alikes
    "amp005_clipping_helper_in_a_condition": case(
        "AMP005",
        """\
        import torch


        def clip_and_check(model):
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            return torch.isfinite(norm)


        def step(model, batch, optimizer, scaler):
            with torch.autocast("cuda"):
                loss = model(batch)
            scaler.scale(loss).backward()
            if clip_and_check(model):
                scaler.step(optimizer)
            scaler.update()
        """,
        reported=True,
    ),
    "amp005_two_scalers": case(
        "AMP005",
        """\
        import torch


        def train_gan(gen, disc, batch, opt_g, opt_d):
            scaler_d = torch.amp.GradScaler("cuda")
            scaler_g = torch.amp.GradScaler("cuda")
            with torch.autocast("cuda"):
                d_loss = disc(batch)
                g_loss = gen(batch)
            scaler_d.scale(d_loss).backward()
            scaler_g.scale(g_loss).backward()
            torch.nn.utils.clip_grad_norm_(disc.parameters(), 1.0)
            scaler_d.step(opt_d)
            scaler_g.step(opt_g)
            scaler_d.update()
            scaler_g.update()
        """,
        reported=True,
    ),
    "amp005_clip_in_a_loop_and_two_optimizers": case(
        "AMP005",
        """\
        import torch


        def per_group(model, batch, optimizer, scaler, groups):
            with torch.autocast("cuda"):
                loss = model(batch)
            scaler.scale(loss).backward()
            for params in groups:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(optimizer)
            scaler.update()


        def two_optimizers(model, batch, opt_a, opt_b, scaler):
            with torch.autocast("cuda"):
                loss = model(batch)
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt_a)
            scaler.step(opt_b)
            scaler.update()
        """,
        reported=True,
    ),
    "amp005_scaler_only_on_some_paths": case(
        "AMP005",
        """\
        import torch


        def step(model, batch, optimizer, scaler, use_amp):
            with torch.autocast("cuda", enabled=use_amp):
                loss = model(batch)
            if use_amp:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if use_amp:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
        """,
        reported=True,
    ),
    "amp005_already_unscaled": case(
        "AMP005",
        """\
        import torch


        def step(model, batch, optimizer, scaler):
            with torch.autocast("cuda"):
                loss = model(batch)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
        """,
    ),
}


def run_fix(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flake8_amp", "fix", *map(str, args)],
        cwd=cwd, capture_output=True, text=True, timeout=600,
    )


def findings(flake8, folder: Path) -> Dict[str, set]:
    """{file stem: {codes}} from a real flake8 run over ``folder``."""
    result = flake8(["--isolated", "--select=AMP", "."], cwd=folder)
    assert result.returncode in (0, 1), result.stderr
    found: Dict[str, set] = {}
    for line in result.stdout.splitlines():
        path, _line, _col, message = line.split(":", 3)
        found.setdefault(Path(path).stem, set()).add(message.split()[0])
    return found


@pytest.fixture(scope="module")
def fixed_folder(tmp_path_factory):
    """Every case written to one folder; flake8 before, one ``fix --write``, flake8 after,
    and a second ``fix`` run."""
    from conftest import _flake8

    folder = tmp_path_factory.mktemp("fix_cases")
    for name, one in CASES.items():
        (folder / f"{name}.py").write_text(one.before, encoding="utf-8")
    before = findings(_flake8, folder)
    first = run_fix("--write", ".", cwd=folder)
    after = findings(_flake8, folder)
    second = run_fix(".", cwd=folder)
    return folder, before, first, after, second


def test_the_write_run_reports_what_it_fixed(fixed_folder):
    _, _, first, _, _ = fixed_folder
    assert first.returncode == 1, first.stderr
    assert "Traceback" not in first.stderr
    fixed = {Path(path).stem for path in re.findall(r"^fixed (\S+\.py): ", first.stderr, re.M)}
    assert fixed == {name for name, one in CASES.items() if one.after is not None}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_file_reads_as_its_case_says_and_compiles(name, fixed_folder):
    folder, before, _, after, _ = fixed_folder
    one = CASES[name]
    text = (folder / f"{name}.py").read_text(encoding="utf-8")
    assert text == (one.after if one.after is not None else one.before)
    compile(text, name, "exec")
    # Every case exercises a real finding of its code, or one the linter does not report.
    reported_before = one.code in before.get(name, set())
    assert reported_before == (one.after is not None or one.reported)
    # Fixed files lint clean for the code; declined findings are still reported.
    assert (one.code in after.get(name, set())) == one.reported


def test_a_second_run_finds_nothing_to_fix(fixed_folder):
    _, _, _, _, second = fixed_folder
    assert (second.returncode, second.stdout) == (0, ""), second.stderr
    assert "nothing to fix" in second.stderr
