"""The final export and recorded weights (#33 item 1): the train ranks write them, the driver
handles paths only, and the folder is what `transformers` loads, single-file or sharded.

- an engine in this process exports itself: one file, or bounded shards plus the HF index,
  and both load with `AutoModelForCausalLM.from_pretrained` to the trainer's logits;
- a real run (local launcher, quickstart config, 3 steps, weights recorded) in which the
  driver's weight-pulling path (`TrainWorkerGroup.named_weights`) raises: `final/` and
  `weights/v{N}/` are still written, load with transformers, and hold the trainer's final
  weights (the final checkpoint's, bit for bit). Before #33 `export_final` and
  `record_weights` pulled the whole model into the driver and this run failed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from areal_like.core.config import TrainConfig, load_config

pytestmark = pytest.mark.timeout(600)


def _logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _trained_engine(tiny_model_dir: Path):
    from tests.train.conftest import make_trajectories
    from train_cluster.batch import build_batch
    from train_cluster.torch_engine import TorchTrainEngine

    cfg = TrainConfig(token_budget=48, lr=1e-2)
    engine = TorchTrainEngine(tiny_model_dir, cfg)
    engine.train_step(build_batch(make_trajectories(n_groups=2, group_size=4), cfg.loss))
    return engine


def test_the_writer_round_trips_every_dtype_and_shape_through_safetensors(tmp_path) -> None:
    """The shards are written straight from the tensors' memory (not by safetensors'
    `save_file`): safetensors reads back what went in, views and empty tensors included."""
    from safetensors.torch import load_file

    from areal_like.models.hf_folder import INDEX_FILE, write_hf_weights

    base = torch.randn(6, 4)
    ts = {"f32": torch.randn(3, 4), "bf16": torch.randn(5).to(torch.bfloat16), "f16": torch.randn(2, 3).half(),
          "scalar": torch.tensor(3), "empty": torch.zeros(0, 2), "bool": torch.tensor([True, False]),
          "transposed": torch.randn(4, 4).t(), "i64": torch.arange(7), "view_a": base[:3], "view_b": base[3:]}
    for sub, limit in (("one", 2**30), ("many", 40)):
        write_hf_weights(tmp_path / sub, ts.items(), max_shard_bytes=limit)
        got: dict[str, torch.Tensor] = {}
        if sub == "one":
            got = load_file(str(tmp_path / sub / "model.safetensors"))
        else:
            index = json.loads((tmp_path / sub / INDEX_FILE).read_text())
            for f in sorted(set(index["weight_map"].values())):
                got.update(load_file(str(tmp_path / sub / f)))
        assert got.keys() == ts.keys()
        for k, t in ts.items():
            assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), (sub, k)


def test_the_reader_gives_what_safetensors_gives_and_names_a_short_file(tmp_path) -> None:
    """`read_hf_weights` (files read, not mapped) against safetensors' own writer and reader,
    single file and shards; a file cut short is refused with its tensor's name."""
    from safetensors.torch import load_file, save_file

    from areal_like.models.hf_folder import read_hf_weights

    ts = {"f32": torch.randn(3, 4), "bf16": torch.randn(5).to(torch.bfloat16), "f16": torch.randn(2, 3).half(),
          "scalar": torch.tensor(3), "empty": torch.zeros(0, 2), "i64": torch.arange(7)}
    save_file(dict(list(ts.items())[:3]), str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(dict(list(ts.items())[3:]), str(tmp_path / "model-00002-of-00002.safetensors"))
    got = read_hf_weights(tmp_path)
    want = {**load_file(str(tmp_path / "model-00001-of-00002.safetensors")),
            **load_file(str(tmp_path / "model-00002-of-00002.safetensors"))}
    assert got.keys() == want.keys() == ts.keys()
    for k in ts:
        assert got[k].dtype == ts[k].dtype and torch.equal(got[k], want[k]) and torch.equal(got[k], ts[k]), k
    cut = tmp_path / "model-00001-of-00002.safetensors"
    cut.write_bytes(cut.read_bytes()[:-4])
    with pytest.raises(ValueError, match=r"ends inside f16"):
        read_hf_weights(tmp_path)


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads /proc/self/maps")
def test_a_loaded_model_holds_its_weights_once_not_through_a_file_mapping(tiny_model_dir) -> None:
    """A mapped weight file stays resident beside the engine's fused copies and beside each
    version written over it (copy-on-write), a second copy of the weights in a server's
    memory: the model is built from tensors of its own, and nothing maps the file."""
    from areal_like.models.lite import LiteCausalLM

    model = LiteCausalLM.from_pretrained(tiny_model_dir)
    weights = sorted(str(f.resolve()) for f in Path(tiny_model_dir).glob("*.safetensors"))
    assert weights
    mapped = Path("/proc/self/maps").read_text()
    assert not [w for w in weights if w in mapped], mapped
    assert sum(p.numel() for p in model.parameters()) > 0


def test_an_engine_exports_one_file_or_bounded_shards_that_transformers_loads(tiny_model_dir, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from areal_like.models.hf_folder import INDEX_FILE, SINGLE_FILE
    from areal_like.orchestration.run_dir import save_hf_folder

    engine = _trained_engine(tiny_model_dir)
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    ref.load_state_dict(dict(engine.named_weights()), strict=False)  # the trainer's weights, tied lm_head
    ids = torch.tensor([[5, 9, 14, 22, 31, 7, 40, 12]])
    with torch.no_grad():
        want = ref(input_ids=ids).logits

    one = save_hf_folder(tmp_path / "one", engine, tiny_model_dir)  # in process: the engine writes
    assert (one / SINGLE_FILE).is_file() and not (one / INDEX_FILE).exists()
    assert torch.equal(_logits(one, ids), want)

    shard = 200_000  # bytes: the 1M-parameter model (4 MB in fp32) in many shards
    sharded = tmp_path / "sharded"
    meta = engine.export_weights(sharded, max_shard_bytes=shard)
    names = sorted(p.name for p in sharded.glob("*.safetensors"))
    n = len(names)
    assert n > 3 and names == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)], names
    assert not list(sharded.glob(".part-*")), "no temporary shard left behind"
    index = json.loads((sharded / INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == set(names) and meta["total_bytes"] == index["metadata"]["total_size"]
    assert set(index["weight_map"]) == {k for k, _ in engine.named_weights()}
    biggest = max(t.numel() * t.element_size() for _, t in engine.named_weights())
    assert all((sharded / f).stat().st_size <= max(shard, biggest) + 16_384 for f in names), "shards are bounded"
    for f in (tiny_model_dir / "config.json",):
        (sharded / f.name).write_bytes(f.read_bytes())
    assert torch.equal(_logits(sharded, ids), want)


def test_a_run_exports_through_the_train_workers_never_the_driver(tiny_model_dir, tmp_path, monkeypatch) -> None:
    from safetensors.torch import load_file

    from areal_like.orchestration.launch import run_both
    from train_cluster.worker_group import TrainWorkerGroup

    def pulled(self):  # noqa: ANN001, ANN202
        raise AssertionError("the driver pulled the whole model (TrainWorkerGroup.named_weights)")

    monkeypatch.setattr(TrainWorkerGroup, "named_weights", pulled)
    run_dir = tmp_path / "run"
    cfg = load_config("configs/quickstart.yaml", [
        f"model.path={tiny_model_dir}", f"run.dir={run_dir}", "cluster.launcher=local", "train.total_steps=3",
        "train.batch_size=2", "rollout.group_size=4", "rollout.response_length=32", "eval.every_n_steps=0",
        "eval.num_samples=4", "staleness.filter_uniform_groups=false", "run.record_weights=true",
        "run.checkpoint_every_n_steps=100"])
    summary = run_both(cfg)
    assert summary["trained"] >= 3 * 8, summary
    final = run_dir / "final"
    assert (final / "config.json").is_file() and (final / "tokenizer.json").is_file()
    got = load_file(str(final / "model.safetensors"))
    ckpt = sorted((run_dir / "checkpoints").glob("v*"))[-1] / "trainer" / "model.safetensors"
    want = load_file(str(ckpt))  # the trainer's final weights (fp32 masters: the model dtype here)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    recorded = sorted(p.name for p in (run_dir / "weights").iterdir())
    assert recorded == ["v0", "v1", "v2", "v3"], recorded
    v3 = load_file(str(run_dir / "weights" / "v3" / "model.safetensors"))
    assert all(torch.equal(v3[k], got[k]) for k in got)
    ids = torch.tensor([[5, 9, 14, 22, 31, 7, 40, 12]])
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    ref.load_state_dict(want, strict=False)
    with torch.no_grad():
        assert torch.equal(_logits(final, ids), ref(input_ids=ids).logits)
