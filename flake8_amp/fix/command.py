"""``python -m flake8_amp fix PATH...``: show (or ``--write``) the mechanical AMP fixes.

This module imports neither libcst nor the fixers until it runs, so ``--help`` and the
message saying what to install work where libcst is missing.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Iterator, List, Sequence, TextIO, Tuple

from flake8_amp.fix import FIXABLE, WITHDRAWN

NOTHING_TO_FIX, FIXES, USAGE_ERROR, SKIPPED_FILES = 0, 1, 2, 3

DESCRIPTION = """\
Rewrite the mechanical AMP findings that flake8-amp reports, where the fix is certain:

  AMP005  insert scaler.unscale_(optimizer) before the clip (one scaler, one optimizer)
  AMP007  -1e9-style fill literals -> torch.finfo(<tensor>.dtype).min / .max
  AMP009  torch.cuda.amp / torch.cpu.amp -> torch.amp, with the device argument

Shows a unified diff; --write applies it. Only what flake8 would report is touched: the
flake8 configuration of the current directory applies (--amp-* options, ignore lists,
per-file-ignores) and so does `# noqa`; every other finding is left as it is (-v says
why). Comments and formatting are kept; a fixed file compiles and lints clean for what
was fixed, and a second run changes nothing. Needs libcst: pip install "flake8-amp[fix]".
"""

EPILOG = """\
examples:
  python -m flake8_amp fix train.py                 # show the diff
  python -m flake8_amp fix --write src/             # apply it to every *.py below src/
  python -m flake8_amp fix --select AMP009 src/ > amp.patch; patch -p0 < amp.patch
  python -m flake8_amp fix -v src/                  # also list findings left alone, and why

exit status:
  0  nothing to fix
  1  fixes shown (or, with --write, applied)
  2  usage error: unknown option or code, a path that does not exist, libcst missing,
     a flake8 configuration the plugin rejects
  3  some file could not be read, decoded, parsed or analysed (reported; the others
     were processed)
"""


def add_parser(commands) -> argparse.ArgumentParser:
    """Register ``fix`` on the ``python -m flake8_amp`` subcommand parser."""
    parser = commands.add_parser(
        "fix",
        help="show or apply the automatic fixes for AMP005, AMP007 and AMP009",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "paths", nargs="+", metavar="PATH", type=Path,
        help="Python files, or directories searched for *.py files",
    )
    parser.add_argument(
        "--write", action="store_true",
        help="apply the fixes to the files instead of showing a diff",
    )
    parser.add_argument(
        "--select", metavar="CODES", type=_codes, default=FIXABLE,
        help=f"comma-separated codes or prefixes to fix (default: all of {', '.join(FIXABLE)})",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true",
        help="also list the findings left alone, with the reason",
    )
    parser.set_defaults(run=run)
    return parser


def _codes(text: str) -> Tuple[str, ...]:
    selected = set()
    for part in filter(None, (p.strip().upper() for p in text.split(","))):
        matching = {code for code in FIXABLE if code.startswith(part)}
        if not matching:
            raise argparse.ArgumentTypeError(
                f"{part} has no automatic fix; fixable codes: {', '.join(FIXABLE)}"
            )
        selected |= matching
    if not selected:
        raise argparse.ArgumentTypeError("no code given")
    return tuple(sorted(selected))


def run(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    try:
        import libcst  # noqa: F401  (the fixers' only dependency beyond the linter's)
    except ImportError as error:
        print(
            f"flake8-amp fix needs libcst, which cannot be imported ({error}); install it with:\n"
            '    pip install "flake8-amp[fix]"     (or: pip install libcst)',
            file=err,
        )
        return USAGE_ERROR
    missing = [str(path) for path in args.paths if not path.exists()]
    if missing:
        print(f"flake8-amp fix: no such file or directory: {', '.join(missing)}", file=err)
        return USAGE_ERROR
    from flake8_amp.fix.driver import Configuration

    try:
        config = Configuration.load(args.select)
    except Exception as error:  # flake8 configuration errors carry their own message
        print(f"flake8-amp fix: the flake8 configuration was rejected: {error}", file=err)
        return USAGE_ERROR

    select = frozenset(args.select)
    tally: Counter = Counter()
    for path in python_files(args.paths):
        status, fixed = _one_file(path, args, select, config, out, err)
        tally[status] += 1
        tally["findings"] += fixed
    fixed_files = tally[FIXES]
    _summary(args.write, tally["findings"], fixed_files, tally[SKIPPED_FILES], err)
    if tally[SKIPPED_FILES]:
        return SKIPPED_FILES
    return FIXES if fixed_files else NOTHING_TO_FIX


def _one_file(path: Path, args, select, config, out: TextIO, err: TextIO) -> Tuple[int, int]:
    """Fix one file as ``args`` say: its outcome as an exit status (FIXES, SKIPPED_FILES or
    NOTHING_TO_FIX) and the number of findings fixed."""
    from flake8_amp.fix.driver import Unreadable, fix_file

    name = str(path)
    try:
        result = fix_file(path.read_bytes(), name, select, config)
    except (OSError, Unreadable) as error:
        reason = f"cannot read: {error.strerror or error}" if isinstance(error, OSError) else error
        print(f"{name}: skipped, {reason}", file=err)
        return SKIPPED_FILES, 0
    for finding, why in result.left_alone:
        if args.verbose or why.startswith(WITHDRAWN):
            where = f"{name}:{finding.line}:{finding.col + 1}: {finding.code}"
            print(f"{where} left alone: {why}", file=err)
    if result.fixed is None:
        return NOTHING_TO_FIX, 0
    if not args.write:
        out.write(unified_diff(result.original_text, result.fixed_text, name))
    else:
        try:
            _replace(path, result.fixed)
        except OSError as error:
            print(f"{name}: skipped, cannot write: {error.strerror or error}", file=err)
            return SKIPPED_FILES, 0
        codes = ", ".join(sorted({f.code for f in result.applied}))
        print(f"fixed {name}: {len(result.applied)} finding(s) ({codes})", file=err)
    return FIXES, len(result.applied)


def _summary(write: bool, findings: int, files: int, skipped: int, err: TextIO) -> None:
    if findings:
        verb = "fixed" if write else "would fix"
        hint = "" if write else "; run with --write to apply"
        print(f"{verb} {findings} finding(s) in {files} file(s){hint}", file=err)
    else:
        print("nothing to fix", file=err)
    if skipped:
        print(f"{skipped} file(s) skipped (see above)", file=err)


#: Directories never searched: caches and version control, and virtual environments.
SKIPPED_DIRECTORIES = frozenset({"__pycache__", "node_modules", "site-packages"})


def python_files(paths: Sequence[Path]) -> Iterator[Path]:
    """Files given by name, and the ``*.py`` files below directories (hidden directories
    and virtual environments left out), each once, in a stable order."""
    seen = set()
    for path in paths:
        found: List[Path] = [path]
        if path.is_dir():
            found = []
            for folder, subfolders, files in os.walk(path):
                subfolders[:] = sorted(
                    d for d in subfolders
                    if not d.startswith(".")
                    and d not in SKIPPED_DIRECTORIES
                    and not (Path(folder, d) / "pyvenv.cfg").exists()
                )
                found += [Path(folder, f) for f in sorted(files) if f.endswith(".py")]
        for file in found:
            key = os.path.realpath(file)
            if key not in seen:
                seen.add(key)
                yield file


def unified_diff(before: str, after: str, name: str) -> str:
    """A unified diff that ``patch -p0`` applies (with the "no newline" marker it needs)."""
    lines = difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True), name, name
    )
    return "".join(
        line if line.endswith(("\n", "\r")) else line + "\n\\ No newline at end of file\n"
        for line in lines
    )


def _replace(path: Path, content: bytes) -> None:
    """Write ``content`` to ``path`` through a temporary file in the same folder, so an
    interrupted write leaves the old file whole; the file's permissions are kept."""
    path = Path(os.path.realpath(path))  # through a symbolic link, not over it
    mode = path.stat().st_mode
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(content)
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
