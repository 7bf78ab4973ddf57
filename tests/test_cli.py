"""The `expertstream` entry point: instant help, lazy subcommands, every subcommand's parser builds, and a
user's mistakes end as one sentence and a non-zero exit, before torch loads where the flags alone say so."""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from expertstream.cli import COMMANDS, main, subcommand_parser

REPO = Path(__file__).resolve().parents[1]


def run_cli(*argv: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "EXPERTSTREAM_TRACEBACK": ""}
    return subprocess.run(
        [sys.executable, "-m", "expertstream", *argv], capture_output=True, text=True, env=env, **kw
    )


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


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("expertstream ")


def _parser(name: str) -> argparse.ArgumentParser:
    return subcommand_parser(name)[1]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_default_is_said_once_in_help(name):
    parser = _parser(name)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        text = formatter._expand_help(action).lower()
        meaningful = action.default not in (None, False, "", [], argparse.SUPPRESS)
        assert text.count("default") == 1 if meaningful else text.count("default") <= 1, (
            f"{name} {action.option_strings}: {text}"
        )


def test_ctx_size_is_shown_beside_max_model_len(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--max-model-len MAX_MODEL_LEN, --ctx-size MAX_MODEL_LEN" in capsys.readouterr().out.replace(
        "\n", " "
    )
    assert _parser("serve").parse_args(["--ctx-size", "512"]).max_model_len == 512


def bad_inputs(workdir: Path, snapshot: Path, empty: Path) -> list[list[str]]:
    """Every subcommand with each mistake that applies to it (WORKDIR-taking ones get a real workdir where
    the mistake is elsewhere, so the check under test is the one that fires)."""
    wd, none = str(workdir), "/nonexistent/workdir"
    cases = [
        ["synth", str(empty / "out"), "--layers", "-1"],
        ["setup", none, str(empty / "wd")],
        ["setup", str(snapshot), str(workdir)],  # finished: refused without --force
        ["verify", none],
        ["verify", str(empty)],
        ["check", none, "--snapshot", none],
        ["ppl", none, "--text", none],
        ["ppl", wd, "--text", none],
        ["bench", "nope"],
    ]
    for cmd in ("generate", "chat", "serve", "plan"):
        prompt = ["--prompt", "Hi"] if cmd == "generate" else []
        cases += [
            [cmd, none, *prompt],
            [cmd, str(empty), *prompt],
            [cmd, str(snapshot), *prompt] if cmd != "plan" else [cmd, str(empty / "config.json")],
            [cmd, wd, *prompt, "--max-model-len", "-1"],
            [cmd, wd, *prompt, "--gpu-memory-utilization", "1.5"],
            [cmd, wd, *prompt, "--no-such-flag"],
        ]
        if cmd != "plan":
            cases += [
                [cmd, wd, *prompt, "--max-tokens", "-1"],
                [cmd, wd, *prompt, "--temperature", "-1"],
                [cmd, wd, *prompt, "--top-p", "0"],
                [cmd, wd, *prompt, "--repetition-penalty", "0"],
            ]
            if not torch.cuda.is_available():
                cases.append([cmd, wd, *prompt, "--device", "cuda"])
    cases += [
        ["generate", wd, "--prompt", ""],
        ["generate", wd, "-f", str(empty / "missing.txt")],
        ["generate", wd, "--prompt", "And God said " * 400, "--max-model-len", "64"],  # over-long
        ["plan", "nvidia/Qwen3.8-Flash-Next-NVFP4", "--gpu-memory-gb", "8"],  # offline below
        ["chat", wd, "-f", str(empty / "missing.txt")],
    ]
    return cases


def test_every_mistake_is_one_sentence_and_a_nonzero_exit(tiny_workdir, tiny_snapshot, tmp_path, capsys,
                                                            monkeypatch):  # fmt: skip
    def offline(*a, **k):
        raise OSError(-3, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "create_connection", offline)
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv in bad_inputs(tiny_workdir, tiny_snapshot, empty):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse: a usage error
            code = e.code
        err = capsys.readouterr()
        text = err.out + err.err
        assert code in (1, 2), f"{argv[:4]} exited {code}"
        assert "Traceback" not in text, argv
        if code == 2:  # argparse's usage and one error line
            assert "error:" in text.strip().splitlines()[-1], argv
            continue
        # what is said, log lines (timestamped) and progress bars aside: a sentence, or verify's report
        said = [line for line in text.splitlines() if line and not line[0].isdigit() and "%|" not in line]
        assert 1 <= len(said) <= 2 and all(len(line) < 400 for line in said), f"{argv[:4]}: {said}"
    assert Path(tiny_workdir, "manifest.json").is_file()  # the refused setup left the workdir alone


def test_flag_mistakes_are_refused_before_torch_loads(tiny_workdir, tmp_path):
    # a fresh interpreter, so that torch is not loaded yet; each case must fail without importing it
    empty = tmp_path / "empty"
    empty.mkdir()
    wd = str(tiny_workdir)
    cases = [
        ["generate", "/nonexistent", "--prompt", "Hi"],
        ["generate", str(empty), "--prompt", "Hi"],
        ["generate", wd, "--prompt", "Hi", "--max-tokens", "-1"],
        ["generate", wd, "--prompt", "Hi", "--temperature", "-1"],
        ["generate", wd, "--prompt", ""],
        ["chat", wd, "--temperature", "-1"],
        ["chat", "/nonexistent"],
        ["plan", wd, "--max-model-len", "0"],
        ["plan", "/nonexistent"],
        ["serve", "/nonexistent"],
        ["serve", wd, "--temperature", "-1"],
        ["serve", wd, "--max-tokens", "-1"],
    ]
    code = (
        "import json, sys\nfrom expertstream.cli import main\nout = []\n"
        f"for argv in {cases!r}:\n"
        "    rc = main(argv)\n    out.append([rc, 'torch' in sys.modules])\nprint(json.dumps(out))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    results = json.loads(res.stdout.strip().splitlines()[-1])
    assert "Traceback" not in res.stderr
    for argv, (rc, torch_loaded) in zip(cases, results):
        assert rc == 1 and not torch_loaded, argv
    assert res.stderr.count("error:") == len(cases)


def test_serve_on_a_port_in_use_is_one_sentence(tiny_workdir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = run_cli("serve", str(tiny_workdir), "--port", str(port), timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr and "Aborted" not in res.stderr
    assert f"--port {port} on 127.0.0.1 is in use" in res.stderr.strip().splitlines()[-1]


def test_ctrl_c_ends_generate_quietly(tiny_workdir):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [
        "generate",
        str(tiny_workdir),
        "--prompt",
        "Hello",
        "--max-tokens",
        "3000",
        "--max-model-len",
        "4096",
    ]
    # SIGINT's default action, as under a terminal (a pytest-xdist worker ignores it; children inherit that)
    proc = subprocess.Popen([sys.executable, "-m", "expertstream", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        proc.stdout.read(1)  # the first generated character: the engine is in its decode loop
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
