"""The staleness ablation's statistics (bench/staleness_ablation.py, #34): no scipy, so the t
quantile, the t CDF and the paired tests are checked here against tabulated values and by hand."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import staleness_ablation as sa  # noqa: E402


@pytest.mark.parametrize(("df", "q975"), [(1, 12.7062), (2, 4.3027), (3, 3.1824), (7, 2.3646), (15, 2.1314),
                                          (30, 2.0423), (120, 1.9799)])
def test_t_quantile_matches_the_table(df: int, q975: float) -> None:
    assert sa.t_quantile(0.975, df) == pytest.approx(q975, abs=1e-4)
    assert sa.t_quantile(0.025, df) == pytest.approx(-q975, abs=1e-4)
    assert sa.t_cdf(q975, df) == pytest.approx(0.975, abs=1e-5)


def test_t_cdf_df1_is_cauchy() -> None:
    for t in (-3.0, -0.5, 0.0, 0.7, 10.0):
        assert sa.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-10)


def test_mean_ci_by_hand() -> None:
    # 1, 2, 3, 4: mean 2.5, sd sqrt(5/3), t(0.975, 3) = 3.18245
    m, lo, hi = sa.mean_ci([1.0, 2.0, 3.0, 4.0])
    half = 3.182446 * math.sqrt(5 / 3) / 2
    assert (m, lo, hi) == pytest.approx((2.5, 2.5 - half, 2.5 + half), abs=1e-5)
    assert sa.mean_ci([0.7]) == (0.7, 0.7, 0.7)


def test_sign_flip_exact_and_drawn() -> None:
    # All 8 differences positive: only the all-+ and all-− patterns reach |mean|: p = 2/256.
    assert sa.sign_flip_p([0.1] * 8) == pytest.approx(2 / 256)
    # 1, 2, -3: patterns with |sum| >= 0 are all 8 -> p = 1; 3, 1, 1: |sum| 5 reached by ±(3,1,1) only -> 2/8.
    assert sa.sign_flip_p([1.0, 2.0, -3.0]) == 1.0
    assert sa.sign_flip_p([3.0, 1.0, 1.0]) == pytest.approx(0.25)
    # Beyond 16 pairs, random patterns from a fixed RNG: deterministic, and close to the exact value.
    d = [1.0] * 17
    assert sa.sign_flip_p(d, draws=2000) == sa.sign_flip_p(d, draws=2000) < 0.01


def test_paired_by_hand() -> None:
    # Issue #34's numbers at η = 8: naive 0.813/0.840/0.816, decoupled 0.742/0.781/0.945.
    p = sa.paired([0.813, 0.840, 0.816], [0.742, 0.781, 0.945])
    diffs = [-0.071, -0.059, 0.129]
    sd = math.sqrt(sum((x - sum(diffs) / 3) ** 2 for x in diffs) / 2)
    half = 4.302653 * sd / math.sqrt(3)
    assert p["n"] == 3 and p["b_wins"] == 1
    assert p["diff_mean"] == pytest.approx(-0.0003, abs=1e-4)
    assert p["diff_ci"] == pytest.approx([-0.0003 - half, -0.0003 + half], abs=2e-4)
    assert p["p_t"] > 0.99 and p["p_signflip"] == 1.0
    # A consistent gain is found: +0.05 ± 0.01 on 8 seeds.
    q = sa.paired([0.5] * 8, [0.55, 0.56, 0.54, 0.55, 0.56, 0.54, 0.55, 0.55])
    assert q["diff_ci"][0] > 0 and q["p_t"] < 1e-6 and q["p_signflip"] == pytest.approx(2 / 256, abs=1e-4)


def _run(cfg: str, eta: int, mode: str, seed: int, acc: float) -> dict:
    return {"config": cfg, "eta": eta, "mode": mode, "seed": seed, "eval_accuracy": acc, "final_reward": acc,
            "mean_version_lag": 1.0, "max_version_lag": eta, "behav_weight_max": 2.0, "prox_gap_max": 0.1,
            "capped_or_masked": 0.0, "other_cores": 0.1, **{k: 0.01 for k in sa.STEP_MEANS.values()}}


def test_tabulate_pairs_by_seed_and_plots(tmp_path: Path) -> None:
    runs = [_run("quickstart", e, m, s, 0.5 + 0.01 * s + (0.02 if m == "decoupled" else 0.0))
            for e in (0, 8) for m in ("naive", "decoupled") for s in range(4)]
    runs.append(_run("quickstart", 8, "naive", 9, 0.1))  # no decoupled partner: left out of the pair
    cells, pairs = sa.tabulate(runs, ["quickstart"], [0, 8], ["naive", "decoupled"])
    assert len(cells) == 4 and len(pairs) == 2
    p8 = next(p for p in pairs if p["eta"] == 8)
    assert p8["seeds"] == [0, 1, 2, 3] and p8["diff_mean"] == pytest.approx(0.02)
    assert p8["b_wins"] == 4 and p8["p_signflip"] == pytest.approx(2 / 16, abs=1e-4)
    md = sa.markdown(cells, pairs, "python bench/staleness_ablation.py", "test")
    assert "| quickstart | 8 | final version | decoupled − naive | 4 | +0.020" in md
    assert "along the run" not in md  # no curve without --eval-every
    sa.plot(cells, pairs, ["quickstart"], [0, 8], ["naive", "decoupled"], tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_the_curve_mean_is_paired_beside_the_final_accuracy(tmp_path: Path) -> None:
    """With --eval-every, each run's held-out curve is averaged over the due versions and
    that mean is tested per seed beside the final version's accuracy: two objectives that
    end on the same plateau can still differ in how fast they got there."""
    import json

    runs = []
    for m in ("naive", "decoupled"):
        for s in range(4):
            d = tmp_path / f"{m}{s}"
            d.mkdir()
            # Both end at 0.9; decoupled is 0.1 ahead at versions 5 and 10. v0 and v7 are not due.
            curve = {0: 0.5, 5: 0.6 + (0.1 if m == "decoupled" else 0) + 0.01 * s, 7: 0.1,
                     10: 0.7 + (0.1 if m == "decoupled" else 0), 15: 0.9}
            (d / "metrics.jsonl").write_text("".join(
                json.dumps({"kind": "eval", "version": v, "accuracy": a}) + "\n" for v, a in curve.items()))
            c = sa.curve_stats(d, 5, 15)
            assert c["curve_points"] == 3
            runs.append({**_run("quickstart", 8, m, s, 0.9), **c})
    cells, pairs = sa.tabulate(runs, ["quickstart"], [8], ["naive", "decoupled"])
    final = next(p for p in pairs if p["metric"] == "final")
    curve = next(p for p in pairs if p["metric"] == "curve")
    assert final["diff_mean"] == pytest.approx(0.0) and curve["diff_mean"] == pytest.approx(0.2 / 3, abs=1e-4)
    assert next(c for c in cells if c["mode"] == "naive")["curve_mean"] == pytest.approx((0.6 + 0.015 + 0.7 + 0.9) / 3,
                                                                                          abs=1e-4)
    md = sa.markdown(cells, pairs, "cmd", "test")
    assert "| quickstart | 8 | along the run | decoupled − naive | 4 | +0.067" in md
    sa.plot_curves(runs, ["quickstart"], [8], ["naive", "decoupled"], tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 1000


def test_a_late_fall_is_counted_per_cell(tmp_path: Path) -> None:
    """A run whose final version sits FALL_AT or more under its best evaluated version fell;
    the cell counts them, and shows the mean of each run's largest late step."""
    import json

    runs = []
    for s, final in enumerate((0.9, 0.9, 0.6, 0.76)):  # seeds 2 and 3 fell from 0.92: by 0.32 and 0.16
        d = tmp_path / f"r{s}"
        d.mkdir()
        steps = [{"kind": "train_step", "step": k, "theta_prox_gap": 0.05 if k == 8 else 0.01} for k in range(1, 10)]
        evals = [{"kind": "eval", "version": v, "accuracy": a} for v, a in ((3, 0.7), (6, 0.92), (9, final))]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps + evals))
        c = sa.curve_stats(d, 3, 9)
        assert c["fall"] == pytest.approx(0.92 - final)
        w = sa.weight_stats(d)
        assert w["step_move_late_max"] == pytest.approx(0.05)
        runs.append({**_run("quickstart", 8, "decoupled", s, final), **c, "step_move_late_max": 0.05})
    cells, _ = sa.tabulate(runs, ["quickstart"], [8], ["decoupled"])
    assert cells[0]["falls"] == 2 and cells[0]["step_move_late_max"] == pytest.approx(0.05)
    assert "| 2/4 | 0.0500 |" in sa.markdown(cells, [], "cmd", "t")


def test_a_variant_is_an_objective_of_its_own_paired_with_naive(tmp_path: Path) -> None:
    """`--variant NAME=BASE,KEY=VALUE` adds an objective to the grid: its runs are tabulated
    and paired with naive per seed like decoupled's, and plotted beside them."""
    assert sa.parse_variant("tight=decoupled,train.loss.eps_clip=0.1, train.lr=5e-5") == (
        "tight", "decoupled", ["train.loss.eps_clip=0.1", "train.lr=5e-5"])
    for bad, why in (("tight", "expected NAME=BASE"), ("tight=", "expected NAME=BASE"),
                     ("tight=ppo,train.lr=1", "BASE must be naive or decoupled"),
                     ("tight=decoupled,train.lr", "not KEY=VALUE"), ("a b=decoupled", "expected NAME=BASE"),
                     ("decoupled=decoupled,train.lr=1", "built-in")):
        with pytest.raises(ValueError, match=why):
            sa.parse_variant(bad)
    modes = ["naive", "decoupled", "tight"]
    runs = [_run("quickstart", 8, m, s, 0.5 + 0.01 * s + {"naive": 0.0, "decoupled": 0.02, "tight": 0.05}[m])
            for m in modes for s in range(4)]
    cells, pairs = sa.tabulate(runs, ["quickstart"], [8], modes)
    assert [c["mode"] for c in cells] == modes
    by_b = {p["b"]: p for p in pairs}
    assert set(by_b) == {"decoupled", "tight"} and all(p["a"] == "naive" for p in pairs)
    assert by_b["tight"]["diff_mean"] == pytest.approx(0.05) and by_b["tight"]["b_wins"] == 4
    assert "| quickstart | 8 | final version | tight − naive | 4 | +0.050" in sa.markdown(cells, pairs, "cmd", "t")
    sa.plot(cells, pairs, ["quickstart"], [8], modes, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_write_doc_replaces_only_the_marked_part(tmp_path: Path) -> None:
    doc = tmp_path / "b.md"
    doc.write_text(f"# x\nprose\n{sa.DOC_BEGIN}\nold\n{sa.DOC_END}\nmore prose\n")
    sa.write_doc("new table\n", doc)
    assert doc.read_text() == f"# x\nprose\n{sa.DOC_BEGIN}\nnew table\n{sa.DOC_END}\nmore prose\n"
    # The real doc carries the markers once each.
    text = sa.DOC.read_text()
    assert text.count(sa.DOC_BEGIN) == 1 and text.count(sa.DOC_END) == 1
