"""Run the `specserve` command in-process: (exit status, stderr)."""

from __future__ import annotations

import pytest


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    from specserve.cli import main

    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own errors
        rc = int(exc.code or 0)
    return rc, capsys.readouterr().err
