"""SARIF for GitHub code scanning: ``flake8 --select=AMP --format=sarif`` (the flake8-sarif
formatter plugin) then ``python -m flake8_amp.sarif``, which adds each AMP rule's name,
documentation page and severity (P0 error, P1 warning, P2 note)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flake8_amp.catalog import RULES
from flake8_amp.sarif import DOCS_URL, LEVELS

pytest.importorskip("flake8_sarif_reporter", reason="the test requirements install flake8-sarif")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/buggy_train.py"


def flake8_sarif(command, cwd, sarif: Path):
    """``COMMAND --format=sarif > SARIF``, as the docs' workflow writes it (flake8-sarif does
    not close ``--output-file``: a small output never reaches it)."""
    with sarif.open("w") as out:
        return subprocess.run([*command, "--format=sarif"], cwd=cwd, stdout=out,
                              stderr=subprocess.PIPE, text=True, timeout=300)


def annotate(*args):
    return subprocess.run([sys.executable, "-m", "flake8_amp.sarif", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def findings(tmp_path_factory):
    """flake8's own findings and the SARIF file of the same run, as a CI job writes it."""
    folder = tmp_path_factory.mktemp("sarif")
    sarif = folder / "flake8.sarif"
    common = [sys.executable, "-m", "flake8", "--select=AMP", "--isolated"]
    plain = subprocess.run([*common, EXAMPLE], cwd=ROOT, capture_output=True, text=True)
    formatted = flake8_sarif([*common, EXAMPLE], ROOT, sarif)
    assert plain.returncode == formatted.returncode == 1, formatted.stderr
    found = set()
    for line in plain.stdout.splitlines():
        path, row, col, rest = line.split(":", 3)
        found.add((path, int(row), rest.split()[0]))
    return found, sarif


def test_the_formatter_alone_knows_no_rule_page_or_severity(findings):
    _, sarif = findings
    rules = json.loads(sarif.read_text())["runs"][0]["tool"]["driver"]["rules"]
    assert rules and not any("helpUri" in rule for rule in rules)


def test_annotated_sarif_has_every_finding_with_its_rule_page_and_severity(findings, tmp_path):
    found, sarif = findings
    out = tmp_path / "annotated.sarif"
    result = annotate(sarif, "-o", out)
    assert result.returncode == 0, result.stderr
    run = json.loads(out.read_text())["runs"][0]
    rules = run["tool"]["driver"]["rules"]
    located = set()
    for item in run["results"]:
        code = item["ruleId"]
        region = item["locations"][0]["physicalLocation"]
        located.add((region["artifactLocation"]["uri"], region["region"]["startLine"], code))
        rule = rules[item["ruleIndex"]]
        assert rule["id"] == code
        level = LEVELS[RULES[code].severity]
        assert item["level"] == rule["defaultConfiguration"]["level"] == level
    assert located == found and {code for *_, code in found} >= {"AMP005", "AMP006", "AMP009"}
    for rule in rules:
        code = rule["id"]
        assert rule["name"] == RULES[code].name
        assert rule["shortDescription"]["text"] == RULES[code].title
        assert rule["helpUri"] == f"{DOCS_URL}{code}.md"
        assert (ROOT / "docs" / "rules" / f"{code}.md").is_file()  # the page it links to
        assert RULES[code].fix in rule["help"]["markdown"]
        assert RULES[code].severity in rule["properties"]["tags"]
    levels = {rule["defaultConfiguration"]["level"] for rule in rules}
    assert levels == {"error", "note"} | ({"warning"} & levels)  # P0 and P2 are in the example


def test_other_codes_stay_as_the_formatter_wrote_them_and_docs_url_is_an_option(tmp_path):
    source = tmp_path / "train.py"
    source.write_text("import os\nimport torch\nscaler = torch.cuda.amp.GradScaler()\n")
    sarif = tmp_path / "out.sarif"
    flake8_sarif([sys.executable, "-m", "flake8", "--isolated", "--select=F,AMP", "train.py"],
                 tmp_path, sarif)
    before = json.loads(sarif.read_text())
    assert annotate(sarif, "--docs-url", "https://example.org/amp").returncode == 0
    after = json.loads(sarif.read_text())["runs"][0]
    by_id = {rule["id"]: rule for rule in after["tool"]["driver"]["rules"]}
    assert by_id["F401"] == next(r for r in before["runs"][0]["tool"]["driver"]["rules"]
                                 if r["id"] == "F401")
    assert by_id["AMP009"]["helpUri"] == "https://example.org/amp/AMP009.md"
    assert by_id["AMP009"]["defaultConfiguration"]["level"] == "note"  # P2
    assert [r.get("level") for r in after["results"] if r["ruleId"] == "F401"] == [None]


@pytest.mark.parametrize("content, message", [
    ("", "redirect its output instead"),
    ("{not json", "not JSON"),
    ('{"version": "2.1.0"}', 'not a SARIF log (no "runs" list)'),
])
def test_bad_input_is_one_line_and_exit_status_2(tmp_path, content, message):
    sarif = tmp_path / "bad.sarif"
    sarif.write_text(content)
    result = annotate(sarif)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr
    assert sarif.read_text() == content  # nothing lost
    assert annotate(tmp_path / "missing.sarif").stderr.strip().endswith("No such file or directory")


def test_the_documented_workflow_step_writes_an_annotated_sarif(tmp_path):
    yaml = pytest.importorskip("yaml")
    docs = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    block = docs.split("<!-- sarif-workflow", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    steps = yaml.safe_load(block)["jobs"]["amp-lint"]["steps"]
    lint = next(step for step in steps if step.get("name") == "flake8-amp (SARIF)")
    upload = next(step for step in steps if "upload-sarif" in step.get("uses", ""))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text((ROOT / EXAMPLE).read_text(encoding="utf-8"))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-e", "-c", lint["run"]], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    run = json.loads((tmp_path / upload["with"]["sarif_file"]).read_text())["runs"][0]
    assert run["results"] and all(r["ruleId"].startswith("AMP") for r in run["results"])
    assert {r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
            for r in run["results"]} == {"src/train.py"}
    assert all("helpUri" in rule for rule in run["tool"]["driver"]["rules"])
