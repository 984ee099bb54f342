"""int8 weights against float32 on this CPU, in one run: the projection micro-benchmark (SmolLM2-135M's
shapes, 1-32 rows, hot and streamed weights) and the engine's decode tokens/s at 1 and 16 streams.

    PYTHONPATH=$PWD .venv/bin/python scripts/int8_bench.py [--model smollm2-135m-instruct] [--threads 1]
"""

from __future__ import annotations

import argparse
import json

import torch

from tether.engine.quantized_throughput import measure_int8_throughput
from tether.models.int8_bench import SMOLLM2_SHAPES, run_matmul_bench


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15, help="micro-benchmark calls per measurement")
    parser.add_argument("--engine-repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report: dict[str, object] = {
        "matmul": run_matmul_bench(SMOLLM2_SHAPES, [1, 4, 16, 32], args.repeats, [False, True])
    }
    if not args.skip_engine:
        streams = [int(s) for s in args.streams.split(",")]
        report["engine"] = measure_int8_throughput(
            args.model, streams, args.new_tokens, args.engine_repeats, threads=args.threads
        )
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
