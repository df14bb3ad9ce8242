"""Rule metadata for the SARIF a flake8 SARIF formatter writes, for GitHub code scanning.

    flake8 --select=AMP --format=sarif --output-file=flake8.sarif src/
    python -m flake8_amp.sarif flake8.sarif        # adds the AMP rules' metadata, in place

flake8 hands a formatter plugin only each finding's code, place and message, so no SARIF
formatter for flake8 can know an AMP rule's name, its documentation page or its severity
(``flake8-sarif`` marks every code that does not start with ``E`` a warning). This step
fills them in from the catalog, for every AMP rule the file mentions: ``name``, short and
full description, ``help`` (the fix), ``helpUri`` (the rule's page), the level mapped from
P0/P1/P2 (error, warning, note) as the rule's default and on each of its results, and
tags. Results of other codes are left as they are.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Optional, Sequence

from .catalog import RULES, Rule

#: Where the rule pages (``docs/rules/AMPxxx.md``) are published; ``--docs-url`` overrides it.
DOCS_URL = "https://github.com/flake8-amp/flake8-amp/blob/main/docs/rules/"
#: SARIF levels of the catalog's severities: P0 training is broken, P1 degraded, P2 a hint.
LEVELS = {"P0": "error", "P1": "warning", "P2": "note"}


class SarifError(ValueError):
    """The input is not a SARIF log; the message says why, in one line."""


def rule_code(rule_id: str) -> Optional[str]:
    """The AMP code of a SARIF rule id (``AMP005``, or ``flake8/AMP005`` as some formatters
    write it), or None for other codes."""
    code = rule_id.rpartition("/")[2]
    return code if code in RULES else None


def describe(rule: Rule, docs_url: str = DOCS_URL) -> Dict[str, Any]:
    """The SARIF ``reportingDescriptor`` fields of a catalog rule (all but ``id``)."""
    page = f"{docs_url.rstrip('/')}/{rule.code}.md"
    return {
        "name": rule.name,
        "shortDescription": {"text": rule.title},
        "fullDescription": {"text": rule.rationale},
        "help": {"text": f"{rule.fix} See {page}",
                 "markdown": f"{rule.rationale}\n\n**Fix:** {rule.fix}\n\n[{rule.code}]({page})"},
        "helpUri": page,
        "defaultConfiguration": {"level": LEVELS[rule.severity]},
        "properties": {"tags": ["flake8-amp", "mixed-precision", rule.severity],
                       "precision": "high"},
    }


def annotate(log: Dict[str, Any], docs_url: str = DOCS_URL) -> Dict[str, Any]:
    """Add the AMP rules' metadata to a SARIF log (in place, and returned)."""
    if not isinstance(log, dict) or not isinstance(log.get("runs"), list):
        raise SarifError('not a SARIF log (no "runs" list)')
    for run in log["runs"]:
        driver = run.setdefault("tool", {}).setdefault("driver", {"name": "flake8"})
        rules: List[Dict[str, Any]] = driver.setdefault("rules", [])
        index = {entry.get("id"): position for position, entry in enumerate(rules)}
        for result in run.get("results", []):
            code = rule_code(str(result.get("ruleId", "")))
            if code is None:
                continue
            rule_id = result["ruleId"]
            if rule_id not in index:
                index[rule_id] = len(rules)
                rules.append({"id": rule_id})
            result["ruleIndex"] = index[rule_id]
            result["level"] = LEVELS[RULES[code].severity]
        for entry in rules:
            code = rule_code(str(entry.get("id", "")))
            if code is not None:
                entry.update(describe(RULES[code], docs_url))
    return log


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flake8_amp.sarif",
        description="Add the AMP rules' names, documentation links and severities to the SARIF "
                    "file written by `flake8 --format=sarif` (for GitHub code scanning).")
    parser.add_argument("sarif", metavar="FILE", help="the SARIF file flake8 wrote")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="write the result here (default: rewrite FILE)")
    parser.add_argument("--docs-url", default=DOCS_URL, metavar="URL",
                        help=f"where the rule pages are published, ending in / "
                             f"(default: {DOCS_URL})")
    options = parser.parse_args(argv)
    try:
        with open(options.sarif, encoding="utf-8") as fh:
            text = fh.read()
        if not text.strip():
            raise SarifError("empty (flake8-sarif can leave --output-file empty: redirect its "
                             "output instead, flake8 --format=sarif ... > FILE)")
        log = annotate(json.loads(text), options.docs_url)
    except OSError as err:
        parser.exit(2, f"error: {options.sarif}: {err.strerror}\n")
    except json.JSONDecodeError as err:
        parser.exit(2, f"error: {options.sarif}: not JSON ({err})\n")
    except SarifError as err:
        parser.exit(2, f"error: {options.sarif}: {err}\n")
    with open(options.output or options.sarif, "w", encoding="utf-8") as fh:
        json.dump(log, fh, indent=2)
        fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
