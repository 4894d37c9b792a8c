"""LoRA (`model.lora`, docs/lora.md): only the adapters learn, a version on the wire is the
adapter, a server runs it as the merged model, checkpoints resume bit for bit, and the export loads
with PEFT and with any engine as a merged model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from areal_like.core.config import ExperimentConfig, LoraConfig, LossConfig, TrainConfig
from areal_like.models.lora import is_adapter_name
from train_cluster.batch import build_batch
from train_cluster.torch_engine import TorchTrainEngine

LORA = LoraConfig(rank=4, alpha=8)
CFG = TrainConfig(token_budget=64, mini_batches=2, lr=1e-2)


def _trained(model_dir: Path, trajs, steps: int = 2, lora: LoraConfig = LORA) -> TorchTrainEngine:  # noqa: ANN001
    engine = TorchTrainEngine(model_dir, CFG, lora=lora)
    batch = build_batch(trajs(), CFG.loss)
    for _ in range(steps):
        engine.train_step(batch)
    return engine


def _base_weights(engine: TorchTrainEngine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in engine._master_weights() if ".lora_" not in n}


def test_only_the_adapters_learn_and_a_version_is_the_adapter(tiny_model_dir, trajs) -> None:
    engine = TorchTrainEngine(tiny_model_dir, CFG, lora=LORA)
    before = _base_weights(engine)
    batch = build_batch(trajs(), CFG.loss)
    engine.train_step(batch)
    engine.train_step(batch)
    trainable = {id(p) for p in engine._module.parameters() if p.requires_grad}
    names = [n for n, p in engine._module.named_parameters() if p.requires_grad]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert set(map(id, engine.optimizer.state)) == trainable  # Adam's moments for the adapters only
    after = _base_weights(engine)
    assert all(torch.equal(before[n], after[n]) for n in before)  # the base never moves
    wire = dict(engine.named_weights())
    assert wire and all(is_adapter_name(n) for n in wire)
    assert "lm_head.lora_A.weight" not in wire  # tied to the embeddings: all-linear leaves it out
    assert any(n.endswith("lora_B.weight") and t.abs().sum() > 0 for n, t in wire.items())  # B moved from 0
    full = sum(t.numel() for t in before.values())
    assert sum(t.numel() for t in wire.values()) < 0.1 * full


PROMPTS = [[1, 5, 9, 3, 7, 2], [2, 4, 6], [8, 8, 1, 0]]


def _logits(server) -> torch.Tensor:  # noqa: ANN001
    """What a server computes: each prompt's next-token logits."""
    r = server.runner
    with torch.inference_mode():
        return r.forward(r.new_kv(len(PROMPTS), 16), 0, PROMPTS, [0] * len(PROMPTS))


def test_a_server_runs_each_version_as_the_merged_model(tiny_model_dir, trajs, tmp_path) -> None:
    """The embedded engine runs the wire's adapter beside its base weights and computes what
    the merged model the export holds (base + scale·B@A) computes; a second version replaces
    the first, not adds to it (a server that loaded only the second computes the same,
    bit for bit); PEFT's own merge of the exported adapter gives the same weights, and the
    merged model scores the batch as the trainer's adapter model does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from areal_like.orchestration.run_dir import save_hf_folder
    from rollout_cluster.engine import EmbeddedEngine

    engine = _trained(tiny_model_dir, trajs, steps=1)
    server = EmbeddedEngine(tiny_model_dir)
    base = _logits(server)
    server.load_weights(engine.named_weights(), 1)
    batch = build_batch(trajs(), CFG.loss)
    engine.train_step(batch)
    server.load_weights(engine.named_weights(), 2)
    late = EmbeddedEngine(tiny_model_dir)
    late.load_weights(engine.named_weights(), 2)
    out = save_hf_folder(tmp_path / "v2", engine, tiny_model_dir)
    got, want = _logits(server), _logits(EmbeddedEngine(out))
    assert (got - base).abs().max().item() > 1e-3  # the adapter moved the model
    assert (got - want).abs().max().item() < 1e-4
    assert torch.equal(got, _logits(late))
    merged = AutoModelForCausalLM.from_pretrained(out).state_dict()
    peft_merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                            out / "adapter").merge_and_unload().state_dict()
    assert max((peft_merged[k] - merged[k]).abs().max().item() for k in merged) < 1e-6
    as_full = TorchTrainEngine(out, CFG)
    assert (engine.compute_logprobs(batch) - as_full.compute_logprobs(batch)).abs().max().item() < 1e-4


def test_a_bad_adapter_leaves_the_server_on_its_old_weights(tiny_model_dir, trajs) -> None:
    from rollout_cluster.engine import EmbeddedEngine

    wire = list(_trained(tiny_model_dir, trajs, steps=1).named_weights())
    server = EmbeddedEngine(tiny_model_dir)
    before = _logits(server)
    with pytest.raises(ValueError, match="without their pair"):
        server.load_weights(iter(wire[:-1]), 1)
    a_name, a = wire[0]
    with pytest.raises(ValueError, match="do not make its weight's shape"):
        server.load_weights(iter([(a_name, a), (a_name.replace("lora_A", "lora_B"), torch.zeros(3, 3))]), 1)
    with pytest.raises(KeyError, match="not a linear layer"):
        server.load_weights(iter([("model.norm.lora_A.weight", a), ("model.norm.lora_B.weight", a)]), 1)
    assert server.version == 0 and torch.equal(before, _logits(server))


def test_checkpoint_holds_the_adapter_and_resumes_bitwise(tiny_model_dir, trajs, tmp_path) -> None:
    cfg = CFG.model_copy(update={"lr_schedule": "cosine", "total_steps": 10})
    batch = build_batch(trajs(), cfg.loss)
    a = TorchTrainEngine(tiny_model_dir, cfg, lora=LORA)
    a.train_step(batch)
    a.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "ckpt" / "model.safetensors").exists()  # the base is model.path's
    ref = a.train_step(batch)
    b = TorchTrainEngine(tiny_model_dir, cfg, lora=LORA, seed=7)
    b.load(tmp_path / "ckpt")
    got = b.train_step(batch)
    assert got["loss"] == ref["loss"] and b.version == 2
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.named_weights(), b.named_weights(), strict=True))
    full = TorchTrainEngine(tiny_model_dir, cfg)
    with pytest.raises(FileNotFoundError, match="LoRA checkpoint"):
        full.load(tmp_path / "ckpt")


def test_init_from_a_saved_adapter(tiny_model_dir, trajs, tmp_path) -> None:
    from areal_like.orchestration.run_dir import save_hf_folder

    a = _trained(tiny_model_dir, trajs, steps=1)
    out = save_hf_folder(tmp_path / "final", a, tiny_model_dir)
    b = TorchTrainEngine(tiny_model_dir, CFG, lora=LORA.model_copy(update={"init_from": str(out / "adapter")}))
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.named_weights(), b.named_weights(), strict=True))
    # `serve` with the adapter on its base computes what the merged export computes
    from areal_like.orchestration.serve import build_servers
    from rollout_cluster.engine import EmbeddedEngine

    cfg = ExperimentConfig.model_validate({"model": {"path": str(tiny_model_dir), "lora": {
        "rank": 4, "alpha": 8, "init_from": str(out / "adapter")}}})
    got = _logits(build_servers(cfg)[0].engine.engine)
    assert (got - _logits(EmbeddedEngine(out))).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="does not adapt"):
        TorchTrainEngine(tiny_model_dir, CFG, lora=LoraConfig(rank=4, target_modules=["q_proj"],
                                                              init_from=str(out / "adapter")))


def test_lora_settings_refused_before_start(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="matched no linear layer"):
        TorchTrainEngine(tiny_model_dir, CFG, lora=LoraConfig(rank=4, target_modules=["nope_proj"]))
    with pytest.raises(ValueError, match="tied to another"):
        TorchTrainEngine(tiny_model_dir, CFG, lora=LoraConfig(rank=4, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match="megatron is not built"):
        ExperimentConfig.model_validate({"model": {"lora": {"rank": 8}}, "train": {"backend": {"type": "megatron"}}})
    # vLLM takes LoRA versions (its workers merge them: tests/rollout/test_engine_vllm.py)
    ExperimentConfig.model_validate({"model": {"lora": {"rank": 8}}, "rollout": {"engine": {"type": "vllm"}}})
    assert not ExperimentConfig().model.lora.enabled


def test_loss_config_is_untouched_by_lora(tiny_model_dir, trajs) -> None:
    """The decoupled loss and π_prox are the same computation: at step 1 with B = 0 the
    adapter model's logprobs are the base model's exactly."""
    batch = build_batch(trajs(), LossConfig())
    with_lora = TorchTrainEngine(tiny_model_dir, CFG, lora=LORA)
    plain = TorchTrainEngine(tiny_model_dir, CFG)
    assert torch.equal(with_lora.compute_logprobs(batch), plain.compute_logprobs(batch))


def test_adapters_on_some_projections_and_an_untied_head(tiny_model_dir, trajs, tmp_path) -> None:
    """Adapters on only some of a fused site's members (q and v of q/k/v) and on the output
    head of a model whose head is its own weight: the server still computes what the
    merged export computes."""
    from transformers import AutoModelForCausalLM

    from areal_like.orchestration.run_dir import save_hf_folder
    from rollout_cluster.engine import EmbeddedEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 0.5)
    untied = tmp_path / "untied"
    model.save_pretrained(untied)
    for f in Path(tiny_model_dir).iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            (untied / f.name).write_bytes(f.read_bytes())
    engine = _trained(untied, trajs, lora=LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "lm_head"]))
    wire = dict(engine.named_weights())
    assert "lm_head.lora_A.weight" in wire and not any("k_proj" in n for n in wire)
    server = EmbeddedEngine(untied)
    server.load_weights(iter(wire.items()), 1)
    out = save_hf_folder(tmp_path / "v1", engine, untied)
    assert (_logits(server) - _logits(EmbeddedEngine(out))).abs().max().item() < 1e-4


def test_a_vllm_worker_merges_a_lora_version_into_the_folders_weights(tiny_model_dir, trajs):
    """A LoRA version reaches a vLLM worker as the adapter; the worker reloads the model
    folder's every weight with each adapted layer merged (base + scale·B·A), the folder
    read once, and a second version merges from the folder again, not on top."""
    from types import SimpleNamespace

    from safetensors.torch import load_file

    from rollout_cluster.engine.vllm_translate import check_update, checkpoint_schema
    from rollout_cluster.engine.vllm_worker import VLLMWeightExtension, pack_tensors

    trainer = _trained(tiny_model_dir, trajs, steps=1)
    got = []
    ext = VLLMWeightExtension()
    ext.vllm_config = SimpleNamespace(model_config=SimpleNamespace(model=str(tiny_model_dir)))
    ext.model_runner = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(tie_word_embeddings=False)),
                                       reload_weights=lambda weights_iterator: got.append(dict(weights_iterator)))
    wire = list(trainer.named_weights())
    schema = checkpoint_schema(tiny_model_dir)
    check_update(((n, list(t.shape)) for n, t in wire), schema, tied=True)  # the engine side passes it
    ext.areal_load_weights(pack_tensors(wire))
    ext.areal_load_weights(pack_tensors(wire))
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    assert set(got[0]) == set(base) and all(torch.equal(got[0][n], got[1][n]) for n in base)
    w = dict(wire)
    x = "model.layers.0.self_attn.q_proj"
    want = base[f"{x}.weight"] + w[f"{x}.lora_B.weight"] @ w[f"{x}.lora_A.weight"]
    assert torch.allclose(got[0][f"{x}.weight"], want, atol=1e-6)
    assert not torch.equal(got[0][f"{x}.weight"], base[f"{x}.weight"])
    assert torch.equal(got[0]["model.norm.weight"], base["model.norm.weight"])
    with pytest.raises(ValueError, match="does not fit"):
        check_update([(f"{x}.lora_A.weight", [4, 3])], schema, tied=True)
    with pytest.raises(ValueError, match="no linear layer"):
        check_update([("model.nope.lora_B.weight", [4, 3])], schema, tied=True)
