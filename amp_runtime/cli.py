"""``python -m amp_runtime`` (also ``amp-runtime``): run, report, doctor, compare, replay.

    python -m amp_runtime run [options] SCRIPT [ARGS...]   run a script under a guard
    python -m amp_runtime report DIR                       build DIR/report.html
    python -m amp_runtime doctor                           precision support and advice
    python -m amp_runtime compare MODULE:FACTORY           per-module error against fp32
    python -m amp_runtime replay BUNDLE --model M:FACTORY  re-run a failing step, traced

``run`` executes the unmodified script as ``__main__`` the way ``python -m cProfile``
does: ``sys.argv`` is ``[SCRIPT, ARGS...]``, ``sys.path[0]`` is the script's folder, its
exceptions are shown as its own (last, after the guard's summary) and its exit code is kept.
Bad arguments and missing files give one ``error:`` line and exit status 2, never a
traceback.
"""
from __future__ import annotations

import argparse
import builtins
import importlib
import importlib.metadata
import importlib.util
import json
import os
import runpy
import shutil
import sys
import tokenize
import traceback
import types
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from .events import PACKAGE_DIR, GuardError
from .html_report import REPORT_FILE, ReportError, build_report
from .ranks import LOG_FOLDER, launcher_rank, rank_log_dir, report_folders

PROG = "python -m amp_runtime"
DEFAULT_OUT = LOG_FOLDER
USAGE_ERROR = 2


class CliError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise CliError(f"{self.prog}: {message} (see --help)")


def _codes(text: str) -> List[str]:
    codes = [c.strip().upper() for c in text.split(",") if c.strip()]
    if not codes:
        raise argparse.ArgumentTypeError(
            "expected AMP codes or prefixes separated by commas, e.g. AMP1,AMP003")
    return codes


def _version() -> str:
    try:
        return importlib.metadata.version("flake8-amp")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "(not installed)"


def _shape(text: str) -> tuple:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(
            f"expected positive sizes separated by commas, e.g. 8,3,32,32, got {text!r}")
    return shape


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG, description="Runtime guard for PyTorch mixed-precision training.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"""examples:
  {PROG} run train.py --epochs 1      train under the guard; report in amp-report/
  {PROG} report amp-report            rebuild amp-report/report.html from the logs
  {PROG} doctor                       which precision this machine should use
  {PROG} compare model.py:example     which modules to keep in float32
  {PROG} replay amp-report/repro-step5.pt --model model.py:build
                                      re-run a failing step saved by the guard, traced

'{PROG} COMMAND --help' shows a command's options.""",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    run = commands.add_parser(
        "run", help="run a training script under a guard and write a report",
        usage=f"{PROG} run [options] [-m] SCRIPT|MODULE [ARGS...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run SCRIPT as __main__ inside amp_runtime.guard(), as `python SCRIPT ARGS`\n"
                    "would (same sys.argv, sys.path[0] and exit status; with -m, as\n"
                    "`python -m MODULE ARGS` would); write events.jsonl,\n"
                    "metrics.jsonl and report.html to --out; print the events table at the end.\n"
                    "Options go before SCRIPT: everything after it goes to the script unchanged,\n"
                    "even options spelled like run's own (--out, --policy).",
        epilog=f"""examples:
  {PROG} run train.py --epochs 1
  {PROG} run --trace always --out reports/run1 train.py --lr 3e-4
  {PROG} run -m mypkg.train --epochs 1
  {PROG} run --policy raise --select AMP1 train.py   (stop at the first numeric problem)
  {PROG} report reports/run1   (rebuild the page from the logs)""",
    )
    run.add_argument("--policy", choices=("warn", "raise", "record"), default="warn",
                     help="warn (default): print each event; raise: stop at the first P0/P1 event; "
                          "record: only collect")
    run.add_argument("--trace", choices=("off", "auto", "always"), default="auto",
                     help="per-op checks: off, auto (on after an anomaly; default) or always "
                          "(slower; pins the first overflow to its op)")
    run.add_argument("--select", type=_codes, metavar="CODES",
                     help="only these codes/prefixes, e.g. AMP1,AMP003")
    run.add_argument("--ignore", type=_codes, metavar="CODES", help="skip these codes/prefixes")
    run.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                     help=f"folder for the logs and report.html (default: {DEFAULT_OUT}/); "
                          "under torchrun each process writes to DIR/rank-N")
    run.add_argument("--no-report", action="store_true", help="write the logs but not report.html")
    run.add_argument("-m", dest="as_module", action="store_true",
                     help="SCRIPT is a module name: run it as `python -m MODULE ARGS` would")
    # One REMAINDER positional: argparse would drop a "--" that follows a separate SCRIPT
    # positional, and the script must see its arguments exactly as typed.
    run.add_argument("script_argv", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS...]",
                     help="the Python script to run and its arguments")

    report = commands.add_parser(
        "report", help="build report.html from a guard's log folder",
        description="Build one self-contained report.html from events.jsonl/metrics.jsonl in DIR.\n"
                    "For a distributed run (DIR/rank-0, DIR/rank-1, ...: what `run` under\n"
                    "torchrun and the Lightning / Hugging Face callbacks write), one page over\n"
                    "all ranks that names the first failing rank and step.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report.add_argument("dir", metavar="DIR", help="a guard's log_dir (e.g. amp-report/)")
    report.add_argument("--out", metavar="FILE",
                        help=f"where to write the page (default: DIR/{REPORT_FILE})")

    doctor = commands.add_parser(
        "doctor", help="what this machine supports and which precision to use",
        description="Show CUDA devices (capability, tensor cores, fp16/bf16/tf32), CPU autocast "
                    "support, and the recommended autocast dtype and GradScaler settings.",
    )
    doctor.add_argument("--json", action="store_true", help="print JSON instead of text")

    compare = commands.add_parser(
        "compare", help="per-module error of autocast against float32",
        usage=f"{PROG} compare [options] MODULE:FACTORY",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Run a model in float32 and under autocast, compare every module's output and name the
modules to keep in float32 (with a snippet that does it).

MODULE is a module name (mypkg.models) or a .py file; FACTORY, a callable in it, is
called with no arguments, after torch.manual_seed(0) so random inputs repeat, and returns
  - (model, inputs): inputs a tensor, a tuple of positional arguments or a dict of
    keyword arguments, or
  - a model alone (an nn.Module class is such a factory): give --input-shape.""",
        epilog=f"""\
example factory, in model.py:
  def example():
      model = MyNet().eval()
      return model, torch.randn(8, 3, 32, 32)

examples:
  {PROG} compare model.py:example --dtype float16
  {PROG} compare mypkg.models:MyNet --input-shape 8,3,32,32
  {PROG} compare model.py:example --json > errors.json""",
    )
    compare.add_argument("target", metavar="MODULE:FACTORY",
                         help="e.g. mypkg.models:example or model.py:example")
    compare.add_argument("--input-shape", type=_shape, action="append", metavar="SHAPE",
                         help="for a FACTORY that returns only a model: random float32 inputs "
                              "of this shape, e.g. 8,3,32,32 (repeat for more arguments)")
    compare.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16",
                         help="low-precision dtype (default: bfloat16)")
    compare.add_argument("--device-type", metavar="TYPE",
                         help="autocast device type; must be where the model and inputs are "
                              "(default: theirs)")
    compare.add_argument("--tolerance", type=float, metavar="REL_L2",
                         help="own relative L2 error above which a module is named "
                              "(default: 4 x dtype eps)")
    compare.add_argument("--top", type=int, default=20, metavar="N",
                         help="rows in the table (default: 20)")
    compare.add_argument("--json", action="store_true", help="print JSON instead of text")

    replay = commands.add_parser(
        "replay", help="re-run a failing training step saved by the guard, with per-op checks",
        usage=f"{PROG} replay [options] BUNDLE --model MODULE:FACTORY",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Re-run the step a guard saved as a repro bundle (repro-step<N>.pt in its log folder,
written when it replayed a failing step): the same inputs, parameters, buffers, RNG and
autocast state, with per-op checks, to name the first op that produced NaN/Inf (AMP101)
and, when the step's gradients were non-finite, where the backward first made them so
(AMP103).

MODULE is a module name (mypkg.models) or a .py file; FACTORY, a callable in it, is
called with no arguments and returns the model (a fresh one: it gets the bundle's
weights), or a list of models when the step called several (in the bundle's order).
Bundles are read with torch.load(weights_only=True).""",
        epilog=f"""\
example factory, in model.py:
  def build():
      return MyNet(width=256)

examples:
  {PROG} replay amp-report/repro-step5.pt --model model.py:build
  {PROG} replay repro-step5.pt --model mypkg.models:MyNet --device cpu --json""",
    )
    replay.add_argument("bundle", metavar="BUNDLE", help="a repro-step<N>.pt written by a guard")
    replay.add_argument("--model", required=True, metavar="MODULE:FACTORY",
                        help="builds the model(s) to load the bundle into, e.g. model.py:build")
    replay.add_argument("--device", metavar="DEVICE",
                        help="where to run (default: the recorded device if present, else cpu)")
    replay.add_argument("--json", action="store_true", help="print JSON instead of text")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        options = build_parser().parse_args(argv)
        return _COMMANDS[options.command](options)
    except CliError as err:
        print(f"error: {err}", file=sys.stderr)
        return USAGE_ERROR
    except BrokenPipeError:  # output piped into e.g. head, which stopped reading
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


# ---------------------------------------------------------------------------
# run


def _run(options) -> int:
    argv = options.script_argv
    command = argv[1:] if argv[:1] == ["--"] else argv
    if not command:
        what = "MODULE" if options.as_module else "SCRIPT"
        raise CliError(f"{PROG} run: the following arguments are required: {what} (see --help)")
    target, target_args = command[0], command[1:]
    if options.as_module and not _module_exists(target):
        raise CliError(f"run: -m {target}: no such module")
    if not options.as_module and not Path(target).is_file():
        raise CliError(f"run: {target}: no such file")
    import amp_runtime

    base = Path(options.out)
    if base.exists() and not base.is_dir():
        raise CliError(f"run: --out {options.out}: exists and is not a folder")
    rank, world_size = launcher_rank()  # under torchrun: one folder per rank
    out = rank_log_dir(base, rank, world_size)
    try:
        guard = amp_runtime.guard(
            policy=options.policy, trace=options.trace, select=options.select,
            ignore=options.ignore, log_dir=out,
        )
    except (ValueError, TypeError) as err:
        raise CliError(f"run: {err}") from None
    (out / REPORT_FILE).unlink(missing_ok=True)  # the logs are rewritten: it would be stale
    status, error = _run_main(guard, target, target_args, as_module=options.as_module)
    # a terminal's width; logs (CI) get whole messages
    width = max(100, shutil.get_terminal_size().columns) if sys.stderr.isatty() else None
    print(guard.report.summary(width=width), file=sys.stderr)
    if not options.no_report:
        for folder in report_folders(out, base, rank):
            try:
                page = build_report(folder)
                print(f"amp_runtime: report at {page}", file=sys.stderr)
            except ReportError as err:
                print(f"amp_runtime: no report: {err}", file=sys.stderr)
        if out != base and rank == 0:
            print(f"amp_runtime: once every rank has finished, `{PROG} report {base}` "
                  "rebuilds the page over all ranks", file=sys.stderr)
    else:
        print(f"amp_runtime: logs in {out}{os.sep}", file=sys.stderr)
    if error is not None:  # last, as without the guard: a log's tail shows the script's error
        _print_user_traceback(error)
    return status


def _module_exists(name: str) -> bool:
    sys.path.insert(0, os.getcwd())  # where `python -m` looks first
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False
    finally:
        sys.path.pop(0)


def _run_main(guard, target: str, args: List[str],
              as_module: bool) -> Tuple[int, Optional[BaseException]]:
    """Run the script file or module ``target`` as ``__main__`` inside ``guard``, as
    ``python target args`` or ``python -m target args`` would: the exit status it would have,
    and the exception that ended it (its traceback is printed after the report)."""
    saved = sys.argv[:], sys.path[0], sys.modules["__main__"]
    sys.argv[:] = [target, *args]
    try:
        if as_module:
            sys.path[0] = os.getcwd()
            with guard:  # alter_sys: sys.argv[0] and __main__ become the module's, as with -m
                runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            path = str(Path(target).resolve())
            main = types.ModuleType("__main__")
            main.__file__ = path
            main.__builtins__ = builtins
            sys.path[0] = os.path.dirname(path)
            sys.modules["__main__"] = main  # classes defined by the script pickle as __main__.X
            with tokenize.open(path) as fh:
                code = compile(fh.read(), path, "exec")
            with guard:
                exec(code, main.__dict__)
        return 0, None
    except SystemExit as exit_:
        return _exit_status(exit_.code), None
    except BaseException as err:  # shown as the script's own once the report is built
        return (130 if isinstance(err, KeyboardInterrupt) else 1), err
    finally:
        sys.argv[:], sys.path[0], sys.modules["__main__"] = saved


def _exit_status(code) -> int:
    """What Python's own exit would give for ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _print_user_traceback(err: BaseException) -> None:
    """The traceback as the user's own: without this runner's frames before the user's
    code and, for a GuardError, without the guard's frames after the user's line (none at all
    for one judged at the guard's exit, after the script: its message names the line)."""
    tb = err.__traceback__
    guard_error = isinstance(err, GuardError)
    while tb is not None and (_is_runner_frame(tb.tb_frame.f_code.co_filename) or guard_error
                              and tb.tb_frame.f_code.co_filename.startswith(PACKAGE_DIR)):
        tb = tb.tb_next
    if guard_error:
        err.end_at_users_line()
    traceback.print_exception(type(err), err, tb, file=sys.stderr)  # tb None: a SyntaxError


def _is_runner_frame(filename: str) -> bool:
    """This file's frames, and those of runpy/importlib that load a user's module."""
    return filename in (__file__, runpy.__file__) or filename.startswith("<frozen ")


# ---------------------------------------------------------------------------
# report, doctor, compare


def _report(options) -> int:
    try:
        page = build_report(options.dir, options.out)
    except ReportError as err:
        raise CliError(f"report: {err}") from None
    print(page)
    return 0


def _doctor(options) -> int:
    from .doctor import diagnose

    result = diagnose()
    print(json.dumps(result.to_json(), indent=2) if options.json else result)
    return 0


def _compare(options) -> int:
    import torch

    from .compare import compare

    if options.top < 1:
        raise CliError("compare: --top must be at least 1")
    try:
        model, inputs = _model_and_inputs(options, torch)
    except CliError:
        raise
    except Exception as err:  # the user's module or factory failed: show it as their own
        _print_user_traceback(err)
        return 1
    try:
        result = compare(model, inputs, dtype=getattr(torch, options.dtype),
                         device_type=options.device_type, tolerance=options.tolerance)
    except (ValueError, TypeError, RuntimeError) as err:
        raise CliError(f"compare: {err}") from None
    if options.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(result.summary(limit=options.top))
    return 0


def _model_and_inputs(options, torch):
    """Call the factory (seeded, so random inputs repeat) and interpret what it returns."""
    factory, name = _load_factory(options.target)
    torch.manual_seed(0)
    made = factory()
    if isinstance(made, torch.nn.Module):
        if not options.input_shape:
            raise CliError(f"compare: {name}() returned a model without inputs: give "
                           "--input-shape (e.g. --input-shape 8,16) or return (model, inputs)")
        device = next((p.device for p in made.parameters()), torch.device("cpu"))
        return made, tuple(torch.randn(shape, device=device) for shape in options.input_shape)
    if not (isinstance(made, tuple) and len(made) == 2):
        raise CliError(f"compare: {name}() must return (model, inputs) or a model, "
                       f"got {type(made).__name__}")
    if options.input_shape:
        raise CliError(f"compare: {name}() returned its own inputs; --input-shape is for "
                       "factories that return only a model")
    return made


def _load_factory(target: str, command: str = "compare"):
    """FACTORY from MODULE (``module:factory`` or ``file.py:factory``), and its name."""
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"{command}: {target!r} is not MODULE:FACTORY (e.g. model.py:example)")
    if module_name.endswith(".py") or os.sep in module_name:
        path = Path(module_name)
        if not path.is_file():
            raise CliError(f"{command}: {module_name}: no such file")
        sys.path.insert(0, str(path.resolve().parent))
        namespace = runpy.run_path(str(path), run_name=f"amp_runtime_{command}_target")
    else:
        sys.path.insert(0, os.getcwd())
        try:
            namespace = vars(importlib.import_module(module_name))
        except ModuleNotFoundError as err:
            if module_name != err.name and not module_name.startswith(f"{err.name}."):
                raise  # the module was found; an import inside it failed
            raise CliError(f"{command}: cannot import {module_name}: {err}") from None
    factory = namespace.get(attr)
    if not callable(factory):
        raise CliError(f"{command}: {module_name} has no callable {attr!r}")
    return factory, attr


def _replay(options) -> int:
    import torch

    from .replay import BundleError, load_bundle, replay_bundle

    if not Path(options.bundle).is_file():
        raise CliError(f"replay: {options.bundle}: no such file")
    try:
        bundle = load_bundle(options.bundle)
    except BundleError as err:
        raise CliError(f"replay: {err}") from None
    try:
        factory, name = _load_factory(options.model, "replay")
        made = factory()
    except CliError:
        raise
    except Exception as err:  # the user's module or factory failed: show it as their own
        _print_user_traceback(err)
        print(f"error: replay: building the model with {options.model} failed "
              f"({type(err).__name__})", file=sys.stderr)
        return 1
    modules = list(made) if isinstance(made, (list, tuple)) else [made]
    if not modules or not all(isinstance(m, torch.nn.Module) for m in modules):
        raise CliError(f"replay: {name}() must return a torch.nn.Module (or a list of them), "
                       f"got {type(made).__name__}")
    try:
        report, outcome = replay_bundle(bundle, modules, device=options.device)
    except (BundleError, RuntimeError, ValueError) as err:
        raise CliError(f"replay: {err}") from None
    if options.json:
        print(json.dumps({"outcome": outcome.to_json(), **report.to_json()}, indent=2,
                         default=str))
        return 0
    print(_outcome_line(outcome))
    print(report.summary())
    return 0


def _outcome_line(outcome) -> str:
    """What the replay of a bundle found, in one sentence."""
    head = f"replay of step {outcome.step} ({', '.join(outcome.triggers)}):"
    if outcome.skipped:
        return f"{head} did not run: {outcome.skipped}"
    origin = outcome.origin
    if origin is None:
        return f"{head} the replayed step stayed finite"
    if origin.before_forward:
        return f"{head} {origin.clause()}"
    at = f" at {origin.source}" if origin.source else ""
    if origin.phase == "forward":
        return f"{head} the first NaN/Inf came from {origin.describe()}{at}"
    verified = "" if outcome.reproduced else " (the step's non-finite gradients not all reproduced)"
    return f"{head} gradients first turned non-finite in {origin.describe()}{at}{verified}"


_COMMANDS = {"run": _run, "report": _report, "doctor": _doctor, "compare": _compare,
             "replay": _replay}
