"""`areal-like` command line (orchestration layer: may import every package)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import typer

from areal_like.config import ConfigError

app = typer.Typer(
    help="areal_like: fully asynchronous, decoupled RL for language models.",
    no_args_is_help=True,
    add_completion=False,
)
model_app = typer.Typer(help="Create and inspect the small local model.", no_args_is_help=True)
app.add_typer(model_app, name="model")


def _fail(msg: str, code: int = 2) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


@model_app.command("init")
def model_init(
    out: Path = typer.Option(..., "--out", help="Folder to write the HF model + tokenizer to."),
    seed: int = typer.Option(0, help="Initialisation seed."),
) -> None:
    """Create the small Qwen2 model and its character tokenizer (no model hub needed)."""
    from areal_like.tiny_model import init_model

    path = init_model(out, seed=seed)
    typer.echo(f"wrote model and tokenizer to {path}")


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


@app.command()
def audit(
    run_dir: Path = typer.Argument(..., help="A run folder (run.dir)."),
    tol: float = typer.Option(1e-3, help="Largest allowed |recorded - recomputed| behaviour logprob."),
) -> None:
    """Recompute recorded behaviour logprobs under each token's version; check the invariants."""
    import json

    from areal_like.audit import audit_run

    rep = audit_run(run_dir, tol=tol)
    typer.echo(json.dumps(rep.as_dict(), indent=2))
    if rep.missing:
        typer.secho("audit incomplete: " + "; ".join(rep.missing), fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(3)
    if not rep.ok:
        typer.secho(f"audit FAILED: {len(rep.problems)} problem(s)", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    typer.secho(
        f"audit passed: {rep.tokens_checked} tokens of {rep.trajectories} trajectories, "
        f"max logprob error {rep.max_logprob_error:.2e}",
        fg=typer.colors.GREEN,
    )


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="A run folder (run.dir)."),
    out: Path = typer.Option(None, help="Where to write report.png/report.txt (default: the run folder)."),
) -> None:
    """Plot a run's metrics (reward, lag histogram, throughput, idle ratios) and summarise it."""
    from areal_like.report import make_report

    try:
        png, text = make_report(run_dir, out)
    except FileNotFoundError as e:
        _fail(str(e))
    typer.echo(text)
    typer.echo(f"plots: {png}")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app()
    except ConfigError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
