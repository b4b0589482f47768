"""Regenerates ``docs/_static/tensorboard_norms.png``: TensorBoard's scalars page showing the norms.

Runs the demo (2 CPU processes; it logs with ``WeightNormCallback`` and
``EmbeddingNormCallback``), starts a ``tensorboard`` server on 127.0.0.1 over its logs, and
photographs the scalars page with headless Chromium (``apt-get install -y chromium``)::

    .venv/bin/python scripts/screenshot_tensorboard.py [--steps 300] [--out PATH] [--logdir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import quote

ROOT = Path(__file__).resolve().parents[1]
CHROME_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1400,900",
    "--virtual-time-budget=15000",
]


def run_demo(logdir: Path, steps: int) -> None:
    """Trains the demo (which adds both norm callbacks), logging to ``logdir``."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_torchrec.demo",
            "fit",
            f"--trainer.max_steps={steps}",
            "--trainer.val_check_interval=100",
            f"--trainer.default_root_dir={logdir}",
            f"--trainer.logger.init_args.save_dir={logdir}",
        ],
        cwd=ROOT,
        check=True,
    )


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, timeout_s: float = 60.0) -> None:
    """Polls ``url`` until it answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def find_chromium() -> str:
    """The Chromium executable."""
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit("Chromium not found: apt-get install -y chromium")


def screenshot(logdir: Path, out: Path, tag_regex: str) -> None:
    """Serves ``logdir`` with TensorBoard and photographs the scalars page filtered by tags."""
    port = free_port()
    tensorboard = Path(sys.executable).with_name("tensorboard")
    server = subprocess.Popen(
        [str(tensorboard), "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(f"http://127.0.0.1:{port}/data/runs")
        url = f"http://127.0.0.1:{port}/?darkMode=false#scalars&tagFilter={quote(tag_regex)}"
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run(
                [
                    find_chromium(),
                    *CHROME_FLAGS,
                    f"--user-data-dir={profile}",
                    f"--screenshot={out}",
                    url,
                ],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=120,
            )
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    """Parses arguments, runs the demo unless ``--logdir`` is given, takes the screenshot."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=ROOT / "docs/_static/tensorboard_norms.png")
    parser.add_argument("--logdir", type=Path, help="existing logs; skips the demo run")
    parser.add_argument(
        "--tags", default="norm-mean|l2_norm/.*weight", help="regex of the scalar tags to show"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tb-demo-") as tmp:
        logdir = args.logdir or Path(tmp)
        if args.logdir is None:
            run_demo(logdir, args.steps)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        screenshot(logdir, args.out.resolve(), args.tags)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
