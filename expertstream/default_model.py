"""The model used when no WORKDIR is given: prepared once into the cache directory, reused afterwards.

The demo snapshot shipped at `expertstream/assets/demo-snapshot` is set up into `<cache>/demo-<key>`, the key
a hash of the snapshot's place and bytes: each install (venv, checkout) and each shipped revision has a
workdir of its own, so setting one up never rewrites files a process of another install is reading. Setting
one up also removes the demo workdirs no install can use any more (their snapshot gone or changed). The
cache is $EXPERTSTREAM_CACHE or ~/.cache/expertstream.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

from expertstream.log import get_logger
from expertstream.workdir.workdir import MANIFEST, is_current

log = get_logger(__name__)

DEMO_SNAPSHOT = Path(__file__).parent / "assets" / "demo-snapshot"
DEMO_NAME = "demo"  # the bundled model's id on the server (its workdir's name carries a key)
FINGERPRINT = "demo.sha256"  # beside the manifest: which shipped snapshot the workdir was built from


def cache_dir() -> Path:
    return Path(os.environ.get("EXPERTSTREAM_CACHE") or Path.home() / ".cache" / "expertstream")


def demo_fingerprint(snapshot: Path | None = None) -> str:
    """sha256 over every file of a demo snapshot (the shipped one by default; 26 MB: milliseconds). A
    retrained demo keeps the same config and shard sizes, so only the bytes tell a package upgrade apart."""
    h = hashlib.sha256()
    for f in sorted((snapshot or DEMO_SNAPSHOT).iterdir()):
        if f.is_file():
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def demo_workdir_name(fingerprint: str) -> str:
    """`demo-` and 12 hex digits of the shipped snapshot's resolved path and fingerprint."""
    key = hashlib.sha256(f"{DEMO_SNAPSHOT.resolve()}\0{fingerprint}".encode()).hexdigest()[:12]
    return f"demo-{key}"


def _made_from(workdir: Path) -> tuple[Path, str] | None:
    """The snapshot a demo workdir was set up from and that snapshot's fingerprint then; None: unfinished."""
    try:
        source = json.loads((workdir / MANIFEST).read_text())["source"]["snapshot"]
        return Path(source), (workdir / FINGERPRINT).read_text().strip()
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _built_from(workdir: Path, snapshot: Path, fingerprint: str) -> bool:
    """A finished workdir of this format, set up from `snapshot` as its bytes are now (`fingerprint`)."""
    made = _made_from(workdir) if is_current(workdir) else None
    return made is not None and made[1] == fingerprint and made[0].resolve() == snapshot.resolve()


def _unusable(workdir: Path) -> bool:
    """True when no install can use this demo workdir: unfinished, or its snapshot (which it reads the PLE
    table of in place) removed or changed since; an older format's is kept for the install that made it."""
    made = _made_from(workdir)
    return made is None or not (made[0] / "config.json").is_file() or made[1] != demo_fingerprint(made[0])


def _remove_unusable(cache: Path, keep: Path) -> None:
    """Removes the demo workdirs no install can use (under the cache's lock: none is being set up)."""
    for old in sorted(cache.glob("demo*")):
        if old != keep and old.is_dir() and _unusable(old):
            log.info("removing the unused demo workdir %s", old)
            shutil.rmtree(old, ignore_errors=True)


def default_workdir() -> Path:
    """Path of this install's default model workdir, building it on first use (safe against concurrent
    callers, of this install or another)."""
    from expertstream.workdir.repack import setup_workdir

    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    if not (DEMO_SNAPSHOT / "config.json").is_file():
        raise FileNotFoundError(
            f"the bundled demo model is missing from {DEMO_SNAPSHOT}: reinstall expertstream"
        )
    fingerprint = demo_fingerprint()
    workdir = cache / demo_workdir_name(fingerprint)
    # one builder at a time; the others wait here and then find the manifest
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _built_from(workdir, DEMO_SNAPSHOT, fingerprint):
            log.info("default model: %s", workdir)
            return workdir
        _remove_unusable(cache, keep=workdir)
        log.info("setting up the default model %s -> %s (once)", DEMO_SNAPSHOT, workdir)
        setup_workdir(DEMO_SNAPSHOT, workdir, progress=False)
        (workdir / FINGERPRINT).write_text(fingerprint + "\n")
    return workdir


def model_id(workdir: str) -> str:
    """A workdir's name as the server and chat show it: its directory's, `demo` for the bundled model's."""
    path = Path(workdir).resolve()
    demo = path.parent == cache_dir().resolve() and path.name.startswith("demo-")
    return DEMO_NAME if demo else path.name


def resolve_model(model: str) -> str:
    """The given WORKDIR, or the default model's when it is empty."""
    return model or str(default_workdir())
