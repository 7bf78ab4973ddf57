"""The `expertstream` entry point: instant help, lazy subcommands, every subcommand's parser builds."""

import subprocess
import sys

import pytest

from expertstream.cli import COMMANDS, main


def test_help_imports_no_torch():
    # a fresh interpreter: the test process itself has torch loaded already
    code = (
        "import sys\nfrom expertstream.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("False")
    assert all(name in out for name in COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0 and "usage: expertstream " + name in capsys.readouterr().out


def test_unknown_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
