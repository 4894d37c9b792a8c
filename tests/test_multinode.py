"""Two Ray nodes on this machine (`ray.cluster_utils.Cluster`: two raylets, each its own
node id and object store): `cluster.ray_address` joins the cluster, the rollout pool's
servers land on both nodes (`SPREAD`), every server receives the trained versions
straight from the trainer's rank 0, and the counts add up (docs/design.md §10.2)."""

from __future__ import annotations

import os

import pytest

from areal_like.core.config import load_config
from areal_like.core.metrics import read_jsonl

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]  # a two-node Ray cluster (~20 s of Ray start-up)


@pytest.fixture
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


def test_servers_on_both_nodes_receive_trained_versions(two_nodes, tiny_model_dir, tmp_path) -> None:
    from areal_like.orchestration.launch import run_both

    run_dir = tmp_path / "run"
    cfg = load_config("configs/quickstart.yaml", [
        f"model.path={tiny_model_dir}", f"run.dir={run_dir}", f"cluster.ray_address={two_nodes.address}",
        "cluster.rollout_pool.num_cpus=2", "cluster.rollout_pool.strategy=STRICT_SPREAD",
        "rollout.num_servers=2", "train.total_steps=5", "train.batch_size=2", "rollout.group_size=4",
        "rollout.response_length=32", "staleness.max_staleness=1", "staleness.filter_uniform_groups=false",
        "eval.every_n_steps=0", "run.checkpoint_every_n_steps=100"])
    summary = run_both(cfg)
    assert summary["started"] == sum(v for k, v in summary.items() if k != "started"), summary
    recs = read_jsonl(run_dir / "metrics.jsonl")
    final = [r for r in recs if r.get("kind") == "summary"][-1]
    assert final["counts_add_up"], final
    servers = final["servers"]
    assert set(servers) == {"server-0", "server-1"}, servers
    nodes = {s["node"] for s in servers.values()}
    assert len(nodes) == 2, f"servers were not placed on both nodes: {servers}"
    assert nodes == {n.node_id for n in two_nodes.list_all_nodes()}, (nodes, two_nodes.list_all_nodes())
    for name, s in servers.items():
        assert s["version"] >= 4, f"{name} did not get the trained versions: {s}"
        assert s["generated_tokens"] > 0, f"{name} generated nothing: {s}"
