"""`tether sim`: run a job trace through each scheduling policy on a simulated cluster, side by side."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from tether.cli.common import err_console, fail, print_json, user_errors
from tether.errors import ConfigError
from tether.scheduler.cluster import Topology, default_cluster_config, load_cluster
from tether.scheduler.job import JobSpec
from tether.scheduler.placement import CROSS_ISLAND_SLOWDOWN, CROSS_RACK_SLOWDOWN, InterconnectModel
from tether.scheduler.policy import POLICIES, parse_policies

if TYPE_CHECKING:
    from tether.scheduler.simulator import PolicyResult

console = Console()

# Rows of the side-by-side table: (summary key, label, format).
TABLE_ROWS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("avg_jct_s", "avg JCT (h)", lambda v: f"{v / 3600:.2f}"),
    ("p95_jct_s", "p95 JCT (h)", lambda v: f"{v / 3600:.2f}"),
    ("avg_queue_delay_s", "avg queueing delay (h)", lambda v: f"{v / 3600:.2f}"),
    ("makespan_s", "makespan (h)", lambda v: f"{v / 3600:.1f}"),
    ("utilization", "accelerator utilization", lambda v: f"{v:.1%}"),
    ("fragmentation", "fragmentation", lambda v: f"{v:.1%}"),
    ("preemptions", "preemptions", str),
    ("resizes", "elastic resizes", str),
    ("cross_domain_job_share", "jobs spread across domains", lambda v: f"{v:.1%}"),
    ("avg_cross_domain_slowdown_s", "cross-domain slowdown / job (s)", lambda v: f"{v:.0f}"),
    ("avg_straggler_slowdown_s", "straggler slowdown / job (s)", lambda v: f"{v:.0f}"),
    ("stragglers_replaced", "stragglers replaced", str),
    ("stragglers_rescheduled", "stragglers rescheduled", str),
    ("wall_s", "simulation wall (s)", lambda v: f"{v:.1f}"),
)


def results_table(results: dict[str, PolicyResult]) -> Table:
    table = Table(title="scheduling policies side by side")
    table.add_column("metric")
    for name in results:
        table.add_column(name, justify="right")
    for key, label, show in TABLE_ROWS:
        table.add_row(label, *(show(result.summary()[key]) for result in results.values()))
    return table


def _jobs(
    trace: Path | None, synthetic: int | None, seed: int, load: float, topology: Topology
) -> list[JobSpec]:
    from tether.scheduler.trace import SyntheticTrace, load_trace  # numpy: only for a simulation

    if (trace is None) == (synthetic is None):
        fail("give exactly one of --trace FILE or --synthetic N")
    if trace is not None:
        return load_trace(trace)
    assert synthetic is not None
    try:
        return SyntheticTrace(
            jobs=synthetic, seed=seed, load=load, cluster_accelerators=topology.accelerators
        ).generate()
    except ValueError as error:
        raise ConfigError(str(error)) from None


def sim_command(
    cluster_file: Annotated[
        Path | None,
        typer.Option("--cluster", help="Cluster TOML/YAML/JSON; default 128 nodes x 8 accelerators."),
    ] = None,
    trace: Annotated[Path | None, typer.Option("--trace", help="Trace file (.json or .jsonl).")] = None,
    synthetic: Annotated[
        int | None, typer.Option("--synthetic", min=1, max=1_000_000, help="Generate a trace of N jobs.")
    ] = None,
    policy: Annotated[
        str, typer.Option("--policy", help=f"Comma-separated policies: {', '.join(POLICIES)}.")
    ] = ",".join(POLICIES),
    seed: Annotated[int, typer.Option("--seed", help="Seed of the synthetic trace and the stragglers.")] = 0,
    load: Annotated[
        float, typer.Option("--load", help="Offered load of the synthetic trace, as a share of capacity.")
    ] = 0.9,
    cross_island_slowdown: Annotated[
        float, typer.Option("--cross-island-slowdown", help="Run-time factor of a gang split across islands.")
    ] = CROSS_ISLAND_SLOWDOWN,
    cross_rack_slowdown: Annotated[
        float, typer.Option("--cross-rack-slowdown", help="Run-time factor of a gang split across racks.")
    ] = CROSS_RACK_SLOWDOWN,
    no_mitigation: Annotated[
        bool, typer.Option("--no-straggler-mitigation", help="Detect nothing; stragglers run to the end.")
    ] = False,
    out_dir: Annotated[Path, typer.Option("--out-dir", help="Where the JSON and PNG are written.")] = Path(
        "runs"
    ),
    save: Annotated[
        Path | None, typer.Option("--save-trace", help="Also write the trace as JSON Lines.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Simulate a job trace under each policy: JCT, queueing, utilization, fragmentation, slowdowns."""
    from tether.scheduler.report import comparison, write_plot
    from tether.scheduler.simulator import SimConfig, simulate
    from tether.scheduler.trace import save_trace

    with user_errors():
        config = load_cluster(cluster_file) if cluster_file else default_cluster_config()
        topology = Topology.from_config(config)
        policies = parse_policies(policy)
        jobs = _jobs(trace, synthetic, seed, load, topology)
        try:
            sim_config = SimConfig(
                interconnect=InterconnectModel(cross_island_slowdown, cross_rack_slowdown),
                mitigate_stragglers=not no_mitigation,
                seed=seed,
            )
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if save is not None:
            save_trace(jobs, save)
        results: dict[str, PolicyResult] = {}
        for chosen in policies:
            with err_console.status(f"simulating {chosen.name} on {len(jobs)} jobs", spinner="dots"):
                results[chosen.name] = simulate(topology, chosen, jobs, sim_config)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_path = out_dir / f"sim-{stamp}.json"
    plot_path = out_dir / f"sim-{stamp}.png"
    context: dict[str, Any] = {
        "cluster": topology.summary(),
        "trace": {
            "source": str(trace) if trace else "synthetic",
            "jobs": len(jobs),
            "seed": seed,
            "load": load,
        },
        "model": {
            "cross_island_slowdown": cross_island_slowdown,
            "cross_rack_slowdown": cross_rack_slowdown,
            "straggler_mitigation": not no_mitigation,
        },
    }
    payload = comparison(results, context)
    write_plot(results, topology.accelerators, plot_path)
    payload["json_path"], payload["plot_path"] = str(json_path), str(plot_path)
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    if as_json:
        print_json(payload)
        return
    console.print(results_table(results))
    ratio = payload["jct_ratio_topology_vs_fifo"]
    if ratio is not None:
        console.print(f"topology vs fifo average JCT: {ratio:.2f}x ({1 - ratio:.0%} lower)")
    console.print(f"results written to {json_path} and {plot_path}")
