"""The model used when no WORKDIR is given: prepared once into the cache directory, reused afterwards.

The demo snapshot shipped at `expertstream/assets/demo-snapshot` is set up into `<cache>/demo` and set up
again when the shipped one changes (a package upgrade) or lies elsewhere (another install). The cache is
$EXPERTSTREAM_CACHE or ~/.cache/expertstream.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

from expertstream.log import get_logger
from expertstream.workdir.workdir import MANIFEST

log = get_logger(__name__)

DEMO_SNAPSHOT = Path(__file__).parent / "assets" / "demo-snapshot"
FINGERPRINT = "demo.sha256"  # beside the manifest: which shipped snapshot the workdir was built from


def cache_dir() -> Path:
    return Path(os.environ.get("EXPERTSTREAM_CACHE") or Path.home() / ".cache" / "expertstream")


def demo_fingerprint() -> str:
    """sha256 over every file of the shipped demo snapshot (26 MB: milliseconds). A retrained demo keeps the
    same config and shard sizes, so only the bytes tell a package upgrade apart."""
    h = hashlib.sha256()
    for f in sorted(DEMO_SNAPSHOT.iterdir()):
        if f.is_file():
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _stale(workdir: Path) -> bool:
    """True when the shipped demo changed (a package upgrade) since its workdir was set up, or when the
    workdir was set up from the demo of another install (another venv or checkout): it reads the PLE table
    in place there, which may be gone."""
    mark = workdir / FINGERPRINT
    if not mark.is_file() or mark.read_text().strip() != demo_fingerprint():
        return True
    source = json.loads((workdir / MANIFEST).read_text())["source"]["snapshot"]
    return Path(source).resolve() != DEMO_SNAPSHOT.resolve()


def default_workdir() -> Path:
    """Path of the default model's workdir, building it on first use (safe against concurrent callers)."""
    from expertstream.workdir.repack import setup_workdir

    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    if not (DEMO_SNAPSHOT / "config.json").is_file():
        raise FileNotFoundError(
            f"the bundled demo model is missing from {DEMO_SNAPSHOT}: reinstall expertstream"
        )
    workdir = cache / "demo"
    # one builder at a time; the others wait here and then find the manifest
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (workdir / MANIFEST).is_file() and not _stale(workdir):
            log.info("default model: %s", workdir)
            return workdir
        log.info("setting up the default model %s -> %s (once)", DEMO_SNAPSHOT, workdir)
        setup_workdir(DEMO_SNAPSHOT, workdir, progress=False)
        (workdir / FINGERPRINT).write_text(demo_fingerprint() + "\n")
    return workdir


def resolve_model(model: str) -> str:
    """The given WORKDIR, or the default model's when it is empty."""
    return model or str(default_workdir())
