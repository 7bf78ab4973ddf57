"""The model used when no WORKDIR is given: prepared once into the cache directory, reused afterwards.

A snapshot shipped at `expertstream/assets/demo-snapshot` is set up into `<cache>/demo`; until one ships,
`synth --preset tiny` is written to `<cache>/tiny-snapshot` and set up into `<cache>/tiny`. The cache is
$EXPERTSTREAM_CACHE or ~/.cache/expertstream.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from expertstream.log import get_logger
from expertstream.workdir import MANIFEST, read_manifest

log = get_logger(__name__)

DEMO_SNAPSHOT = Path(__file__).parent / "assets" / "demo-snapshot"


def cache_dir() -> Path:
    return Path(os.environ.get("EXPERTSTREAM_CACHE") or Path.home() / ".cache" / "expertstream")


def _stale(workdir: Path) -> bool:
    """True when the shipped demo changed (a package upgrade) since its workdir was set up."""
    from expertstream.formats.snapshot import Snapshot

    source = read_manifest(workdir)["source"]
    snap = Snapshot(DEMO_SNAPSHOT)
    return source["snapshot"] != str(snap.path) or source["config_sha256"] != snap.config_sha256


def default_workdir() -> Path:
    """Path of the default model's workdir, building it on first use (safe against concurrent callers)."""
    from expertstream.repack import setup_workdir

    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    shipped = (DEMO_SNAPSHOT / "config.json").is_file()
    workdir = cache / ("demo" if shipped else "tiny")
    # one builder at a time; the others wait here and then find the manifest
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (workdir / MANIFEST).is_file() and not (shipped and _stale(workdir)):
            log.info("default model: %s", workdir)
            return workdir
        if shipped:
            snapshot = DEMO_SNAPSHOT
        else:
            from expertstream.synth import write_synthetic

            snapshot = cache / "tiny-snapshot"
            log.info("no demo model is bundled yet: writing the tiny synthetic model to %s", snapshot)
            write_synthetic(snapshot, preset="tiny", seed=0)
        log.info("setting up the default model %s -> %s (once)", snapshot, workdir)
        setup_workdir(snapshot, workdir, progress=False)
    return workdir


def resolve_model(model: str) -> str:
    """The given WORKDIR, or the default model's when it is empty."""
    return model or str(default_workdir())
