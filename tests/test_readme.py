"""README.md's snippets run as written: each fenced block after `<!-- ci: server -->` runs against a live
`expertstream serve` of the bundled demo model (started here; the only change to the text is the port, 8000
becoming a free one), each after `<!-- ci: run -->` runs on its own."""

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SNIPPET = re.compile(r"<!-- ci: (server|run) -->\n```(python|bash)\n(.*?)\n```", re.DOTALL)


def snippets() -> list[tuple[str, str, str]]:
    """(mode, language, code) of every marked block."""
    return SNIPPET.findall((REPO / "README.md").read_text())


def env() -> dict:
    # the console script of this interpreter's environment, importing this checkout
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "PYTHONPATH": str(REPO), "PATH": path}


def run(language: str, code: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-c", code] if language == "python" else ["bash", "-eo", "pipefail", "-c", code]
    return subprocess.run(argv, capture_output=True, text=True, env=env(), timeout=600)


def test_the_readme_marks_its_snippets():
    modes = [(mode, language) for mode, language, _ in snippets()]
    # the openai client and curl against the server, and the terminal commands
    assert ("server", "python") in modes and ("server", "bash") in modes and ("run", "bash") in modes
    assert all("openai" in code for mode, lang, code in snippets() if lang == "python")


@pytest.fixture(scope="module")
def server_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "expertstream", "serve", "--port", str(port), "--log-level", "WARNING"]
    proc = subprocess.Popen(argv, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600  # the first use sets the demo model up
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the server did not come up: {proc.stderr.read()[-2000:]}")
            time.sleep(1)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(snippets())))
def test_readme_snippet_runs_as_written(index, request):
    mode, language, code = snippets()[index]
    if "curl " in code and shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    if mode == "server":
        port = request.getfixturevalue("server_port")
        assert "127.0.0.1:8000" in code
        code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    res = run(language, code)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and res.stdout.strip(), (res.stdout, res.stderr[-2000:])
