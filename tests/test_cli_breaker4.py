"""More of a new user's odd inputs to `orchestra plan` / `orchestra compile` / `orchestra cache`
(no GPU): each refused with a message that says what to change (exit 2), or done as asked."""

from __future__ import annotations

import pytest

import orchestra.cli.job_options as jo
from orchestra.cli.main import main


@pytest.fixture
def small_host(monkeypatch):
    monkeypatch.setattr(jo, "host_memory_bytes", lambda: 16 << 30)


@pytest.mark.parametrize("argv", [["--batch-mib", "1e300"],
                                  ["--batch-mib", "1e13", "--batches", "2"]])
@pytest.mark.parametrize("command", ["plan", "run"])
def test_a_job_beyond_64_bit_sizes_is_a_usage_error(small_host, capsys, command, argv):
    # plan printed a plan with 300-digit byte counts (run refused it by the host's memory);
    # then a Buffer of 1e306 bytes reached the graph, which no CUDA size can count
    assert main([command, *argv]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"orchestra {command}: the job needs ")
    # run refuses it by this machine's memory first; plan, which only warns of that, by the
    # 64-bit sizes
    why = ("beyond the 16 EiB a 64-bit size can count" if command == "plan"
           else "but this machine has 16.0 GiB")
    assert err.endswith(f"{why}; pass a smaller --batch-mib or fewer --batches")
    assert len(err) < 300


def test_fmt_bytes_of_huge_sizes():
    assert jo.fmt_bytes(3 << 50) == "3.00 PiB"
    assert jo.fmt_bytes(18 << 60) == "18.0 EiB"
    assert jo.fmt_bytes(10**306) == "8.67e+287 EiB"
    assert jo.fmt_bytes(6 << 40) == "6.00 TiB"
