#!/usr/bin/env python3
"""The adaptive-threads benchmark (issue 22): the demo's training phase idle, then started beside a CPU hog
on one core for its first minute only; prints one JSON object with `busy_start_speed_ratio` (idle wall
time / busy-start wall time, goal >= 0.8), each step's thread count, the load average and the CPU.

    PYTHONPATH=$PWD .venv/bin/python scripts/busy-start.py                 # configs/demo.toml, 16 steps
    PYTHONPATH=$PWD .venv/bin/python scripts/busy-start.py --steps 8 --hog-s 60

SmolLM2 must be in the cache (`tether models pull smollm2-135m-instruct`). See tether/rl/busy_start.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/demo.toml"), help="a demo config")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the config's)")
    parser.add_argument("--hog-s", type=float, default=60.0, help="seconds the hog spins (default 60)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    # Imported once the arguments are checked: torch and the environments take seconds to load.
    from tether.cli.common import sandbox_provider
    from tether.config import load_settings
    from tether.errors import TetherError
    from tether.rl.busy_start import BusyStartConfig, run_busy_start
    from tether.rl.demo import load_demo_config

    try:
        settings = load_settings(None)
        demo = load_demo_config(args.config)
        with tempfile.TemporaryDirectory(prefix="busy-start-") as runs:
            updates: dict[str, object] = {"out_dir": Path(runs), "checkpoint_every": 1_000_000}
            if args.steps is not None:
                updates["steps"] = args.steps
            demo = demo.with_run(**updates)
            if demo.train.model.cache_dir is None:
                demo = demo.with_model(cache_dir=settings.cache_dir)
            config = BusyStartConfig(demo.train, hog_s=args.hog_s)
            report = run_busy_start(config, sandbox=lambda: sandbox_provider(settings))
    except (TetherError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    report["config"] = str(args.config)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
