"""Problems a new user met on a machine without a GPU: --json before the subcommand, an output
that would overwrite the input, the device-memory figure with a small input, a cache folder that
is a file, a full stdout, options checked only after the device check, and the Python API's
raw exceptions. No GPU needed."""

import json

import pytest

from orchestra.cli.main import main, version_info, version_text


# -- 1. --json anywhere on the line ---------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["--json", "plan"], ["plan", "--json"], ["--json", "cache", "info"],
    ["cache", "--json", "info"], ["cache", "info", "--json"],
])
def test_json_before_or_after_the_subcommand(argv, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("ORCHESTRA_CACHE_DIR", str(tmp_path / "cache"))
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out, dict) and out  # one JSON object, not the text report
    assert ("batches" in out) if "plan" in argv else ("entries" in out)


def test_json_before_the_subcommand_makes_errors_json(capsys):
    assert main(["--json", "plan", "--batch-mib", "0"]) == 2
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["exit_code"] == 2


@pytest.mark.parametrize("argv", [["--version", "--json"], ["--json", "--version"]])
def test_version_as_json(argv, capsys):
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == version_info()
    assert version_text().startswith(f"orchestra {out['orchestra']} (Python {out['python']}")


def test_version_as_text(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == version_text()
