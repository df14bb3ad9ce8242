"""The repository passes its own lint: flake8's default checks and flake8-amp, as configured
in setup.cfg (deliberate AMP misuse in runtime tests carries ``# noqa`` with its code)."""


def test_repository_is_clean_under_its_own_flake8_configuration(flake8):
    result = flake8(["."])
    assert "Traceback" not in result.stderr, result.stderr
    assert (result.returncode, result.stdout) == (0, ""), result.stdout + result.stderr
