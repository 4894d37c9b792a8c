"""`TrainEngine`: the trainer interface, and the one train-step algorithm every backend shares.

The orchestrator only ever calls the public methods: `compute_logprobs`,
`train_step`, `named_weights`, `export_weights`, `save`, `load` and `version`. A backend (torch
DDP/FSDP, Megatron-core) supplies how to run its model on a packed micro-batch,
how to reach its parameters and how to checkpoint; the decoupled-PPO step itself —
π_prox recompute, mini-batches, gradient accumulation, global normalisation across
micro-batches and data-parallel ranks, the non-finite skip, the statistics — is
written once here, so both backends train the same objective.

A train step is exactly one version (docs/design.md §1): with `train.mini_batches = k`
it takes k optimizer steps and the version still advances by one. π_prox is the
weights at the start of the step, for every mini-batch. A mini-batch whose loss or
gradient norm is not finite is not applied (its gradients are dropped); a step in
which no mini-batch was applied leaves the weights, the optimizer and the LR
schedule untouched, does not advance the version and is counted in `skipped`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal_like.core.config import LossConfig, TrainConfig
from train_cluster.batch import TrainBatch, balanced_partition, pack_sequences, split_mini_batches
from train_cluster.losses import aggregate, decoupled_ppo_loss, kl_k3, token_entropy, token_logprobs

__all__ = ["TrainEngine", "STAT_KEYS", "lr_factor"]

logger = logging.getLogger(__name__)

STAT_KEYS = (
    "version", "skipped", "skipped_total", "loss", "pg_loss", "kl", "clip_frac", "behav_weight_mean",
    "behav_weight_max", "behav_capped", "behav_masked", "behav_prox_gap", "behav_cut_frac", "dual_clip_frac",
    "neg_behav_clip_frac",
    "theta_prox_gap", "theta_behav_gap", "adv_abs_mean", "adv_zero_frac", "entropy", "grad_norm",
    "lr", "tokens_per_s", "num_seqs", "num_tokens", "num_loss_tokens", "mini_batches_applied",
    "step_time_s", "prox_time_s", "fwd_bwd_time_s", "optimizer_time_s",
)
"""Keys of the dict `train_step` returns (all floats). The times are seconds of this rank:
`step_time_s` the whole step; `prox_time_s` the π_prox (and π_ref) logprob passes before
the first mini-batch; `fwd_bwd_time_s` forward, loss, backward, clipping and their
collectives, and `optimizer_time_s` the optimizer and LR steps, each summed over the
mini-batches (the trainer's step time budget, docs/design.md §10.19).

What the objective did (#34), each a mean over the step's loss tokens: `behav_cut_frac`
the share whose behaviour weight left [lower, cap] (capped or masked; `behav_capped` and
`behav_masked` are the counts), `clip_frac` the share where the PPO clip around π_old
bound (π_prox, or π_behav in the naive ablation), `dual_clip_frac` the dual clip's share,
`neg_behav_clip_frac` the share whose gradient `neg_behav_clip` stopped (A < 0 tokens only),
`behav_prox_gap` / `theta_prox_gap` / `theta_behav_gap` the mean |Δ log π| between the
behaviour, proximal and current policies (θ as each mini-batch's forward sees it: 0 on the
first mini-batch), `adv_abs_mean` the mean |A| and `adv_zero_frac` the share with A = 0."""

# Indices into the summed statistics vector of one step.
_N_S = 17
(_S_LOSS, _S_PG, _S_KL, _S_CLIP, _S_W, _S_CAP, _S_MASK, _S_GAP, _S_ENT, _S_TOK, _S_NUM, _S_DUAL, _S_TPGAP,
 _S_TBGAP, _S_ADV, _S_ADV0, _S_NBC) = range(_N_S)


def lr_factor(step: int, *, schedule: str, warmup: int, total: int) -> float:
    """Multiplier of the base LR after `step` completed train steps.

    Linear warmup over `warmup` steps ((s+1)/warmup), then constant, linear decay to 0
    or cosine decay to 0 at `total`. Stepped once per train step (per version), so the
    schedule follows versions, not the number of mini-batches.
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - progress
    import math

    return 0.5 * (1.0 + math.cos(math.pi * progress))


class TrainEngine(ABC):
    """A policy being trained with decoupled PPO. Backends subclass the hooks at the bottom.

    `version` is the policy version of the current weights: 0 at start (or what a
    checkpoint restored), +1 per applied train step. `skipped` counts train steps
    dropped for a non-finite loss or gradient.
    """

    train_cfg: TrainConfig
    version: int
    skipped: int
    rank: int
    world_size: int
    group: Any
    device: torch.device

    def __init__(self, train_cfg: TrainConfig) -> None:
        self.train_cfg = train_cfg
        self.version = 0
        self.skipped = 0
        if train_cfg.loss.naive_ppo_ablation:
            logger.warning(
                "!!! ABLATION: loss.naive_ppo_ablation=true — behaviour logprobs are used as pi_old and "
                "no importance weight is applied. This is NOT decoupled PPO; use only to compare. !!!"
            )

    # ---- public interface -------------------------------------------------------------------

    @property
    def loss_cfg(self) -> LossConfig:
        return self.train_cfg.loss

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Per-token logprobs [N] of `batch` under the current weights, at each token's T.

        Entry t is log π(token t | its sequence's tokens before t); sequence-first
        tokens get 0. Runs in eval mode without gradients, packed by `token_budget`.
        Under data parallelism each rank passes its own shard.
        """
        return self._logprobs_with(self._forward_logits, batch)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One train step (one version) on this rank's shard of the global batch."""
        t0 = time.perf_counter()
        cfg, loss_cfg = self.train_cfg, self.loss_cfg
        if loss_cfg.naive_ppo_ablation:
            logger.warning("ABLATION step: naive PPO (pi_old = behaviour policy, no importance weight)")
        if loss_cfg.kl_coef > 0:
            batch = batch.with_(ref_logprobs=self._ref_logprobs(batch))
        minis = split_mini_batches(batch, cfg.mini_batches, cfg.mini_batch_split)
        # π_prox is the weights at the start of the step. The first mini-batch's training
        # forward runs exactly those weights: its detached logprobs are the proximal ones,
        # and a second forward would only cost time (docs/design.md §1). The later
        # mini-batches train after an optimizer step, so theirs are computed here, before
        # any step, once and without a graph.
        with torch.no_grad():
            minis = minis[:1] + [m.with_(prox_logprobs=self._logprobs_with(self._forward_logits, m, scored=True))
                                 for m in minis[1:]]
        prox_time = time.perf_counter() - t0

        sums = torch.zeros(_N_S, dtype=torch.float64)
        w_max = torch.zeros(1, dtype=torch.float64)
        grad_norms: list[float] = []
        applied = 0
        fwd_bwd_time = optimizer_time = 0.0  # summed over mini-batches (the step's time budget)
        for mini in minis:
            t = time.perf_counter()
            norm, mini_sums, mini_wmax = self._mini_batch_step(mini)
            finite = bool(torch.isfinite(norm)) and bool(torch.isfinite(mini_sums[_S_LOSS]))
            now = time.perf_counter()
            fwd_bwd_time += now - t
            t = now
            # no loss token in the whole mini-batch (every answer masked, `train.loss.mask_truncated`):
            # zero gradients, and Adam's momentum alone must not move the weights
            empty = self._all_reduce(torch.tensor([float(mini.num_loss_tokens)], dtype=torch.float64)).item() == 0
            if finite:
                if not empty:
                    self._optimizer_step()
                applied += 1
            else:
                logger.warning("non-finite loss or gradient (loss=%s, grad_norm=%s): mini-batch not applied",
                               float(mini_sums[_S_LOSS]), float(norm))
            self._zero_grad()
            self._sync_for_timing()
            optimizer_time += time.perf_counter() - t
            sums += mini_sums
            w_max = torch.maximum(w_max, mini_wmax)
            grad_norms.append(float(norm))

        lr = self._current_lr()
        if applied:
            t = time.perf_counter()
            self._scheduler_step()
            optimizer_time += time.perf_counter() - t
            self.version += 1
        else:
            self.skipped += 1
            logger.warning("train step skipped (non-finite): version stays %d, skipped=%d", self.version,
                           self.skipped)
        elapsed = time.perf_counter() - t0
        tok = max(sums[_S_TOK].item(), 1.0)
        n_mini = cfg.mini_batches
        global_tokens = self._all_reduce(torch.tensor([float(batch.num_tokens), float(batch.num_seqs)],
                                                      dtype=torch.float64))
        return {
            "version": float(self.version),
            "skipped": float(applied == 0),
            "skipped_total": float(self.skipped),
            "loss": sums[_S_LOSS].item() / n_mini,
            "pg_loss": sums[_S_PG].item() / n_mini,
            "kl": sums[_S_KL].item() / tok,
            "clip_frac": sums[_S_CLIP].item() / tok,
            "behav_weight_mean": sums[_S_W].item() / tok,
            "behav_weight_max": w_max.item(),
            "behav_capped": sums[_S_CAP].item(),
            "behav_masked": sums[_S_MASK].item(),
            "behav_prox_gap": sums[_S_GAP].item() / tok,
            "behav_cut_frac": (sums[_S_CAP].item() + sums[_S_MASK].item()) / tok,
            "dual_clip_frac": sums[_S_DUAL].item() / tok,
            "neg_behav_clip_frac": sums[_S_NBC].item() / tok,
            "theta_prox_gap": sums[_S_TPGAP].item() / tok,
            "theta_behav_gap": sums[_S_TBGAP].item() / tok,
            "adv_abs_mean": sums[_S_ADV].item() / tok,
            "adv_zero_frac": sums[_S_ADV0].item() / tok,
            "entropy": sums[_S_ENT].item() / tok,
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "lr": lr,
            "tokens_per_s": global_tokens[0].item() / elapsed,
            "num_seqs": global_tokens[1].item(),
            "num_tokens": global_tokens[0].item(),
            "num_loss_tokens": sums[_S_TOK].item(),
            "mini_batches_applied": float(applied),
            "step_time_s": elapsed,
            "prox_time_s": prox_time,
            "fwd_bwd_time_s": fwd_bwd_time,
            "optimizer_time_s": optimizer_time,
        }

    @abstractmethod
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named weights, for weight sync and export (see the backend for tying rules)."""

    def export_weights(self, path: str | Path, max_shard_bytes: int | None = None) -> dict[str, Any]:
        """Write `named_weights()` as HF safetensors under `path` (a folder), one tensor at a
        time into bounded shards (`areal_like.models.hf_folder`): every rank iterates (the
        gathers are collectives), rank 0 writes. Returns what was written (rank 0)."""
        from areal_like.models.hf_folder import DEFAULT_MAX_SHARD_BYTES, write_hf_weights

        return write_hf_weights(path, self.named_weights(), write=getattr(self, "rank", 0) == 0,
                                max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)

    @abstractmethod
    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        """Write a resumable checkpoint; `extra` (JSON-able, e.g. data position) is returned by load."""

    @abstractmethod
    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore a checkpoint written by `save`; returns its `extra`."""

    # ---- the shared algorithm ------------------------------------------------------------------

    thread_lender: Any = None
    """A `core.cores.ThreadLender` (set by the train worker on a shared machine): the thread
    count is picked again before each micro-batch (forward and backward, or a logprob
    forward), so borrowed threads go back within one micro-batch of the lender resuming."""

    def _pick_threads(self) -> None:
        if self.thread_lender is not None:
            self.thread_lender.pick()

    def _mini_batch_step(self, mini: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Accumulate gradients over the packed micro-batches of one mini-batch; clip.

        The loss of each micro-batch is divided by the *global* token (or sequence)
        count of the mini-batch and multiplied by the world size (DDP/FSDP average
        gradients over ranks), so the summed gradient is that of the whole mini-batch
        as one batch, however it is split.
        """
        loss_cfg = self.loss_cfg
        counts = torch.tensor([float(mini.num_loss_tokens), float(mini.num_seqs)], dtype=torch.float64)
        counts = self._all_reduce(counts)
        denom = counts[0].item() if loss_cfg.agg == "token_mean" else counts[1].item()
        denom = max(denom, 1.0)
        sums = torch.zeros(_N_S, dtype=torch.float64)
        w_max = torch.zeros(1, dtype=torch.float64)
        plan = self._plan(mini)
        self._train_mode(True)
        for i, idx in enumerate(plan):
            last = i == len(plan) - 1
            self._pick_threads()
            with self._grad_sync(last):
                if not idx:  # keeps collectives aligned across ranks; contributes nothing
                    self._dummy_backward()
                    continue
                mb = mini.select(idx)
                rows = _scored_rows(mb)
                logits = self._forward_logits(mb, rows)
                loss, mb_sums, mb_wmax = self._micro_loss(logits, mb, denom, rows)
                (loss * self.world_size).backward()
            sums += mb_sums
            w_max = torch.maximum(w_max, mb_wmax)
        norm = self._clip_grad(self.train_cfg.grad_clip)
        sums = self._all_reduce(sums)
        w_max = self._all_reduce(w_max, op=dist.ReduceOp.MAX)
        return norm, sums, w_max

    def _micro_loss(
        self, logits: torch.Tensor, mb: TrainBatch, denom: float, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`logits` are those of the packed positions `rows` (`_scored_rows`) only."""
        loss_cfg = self.loss_cfg
        dev = logits.device
        lp = _shifted_logprobs(logits, mb, dev, rows)
        mask = mb.loss_mask.to(dev)
        prox = mb.prox_logprobs.to(dev) if mb.prox_logprobs is not None else lp.detach()
        behav = mb.behav_logprobs.to(dev)
        adv = mb.advantages.to(dev)
        terms = decoupled_ppo_loss(
            lp, prox, behav, adv, mask,
            eps_clip=loss_cfg.eps_clip, eps_clip_high=loss_cfg.eps_clip_high,
            behav_weight_cap=loss_cfg.behav_weight_cap, behav_weight_mode=loss_cfg.behav_weight_mode,
            naive_ppo_ablation=loss_cfg.naive_ppo_ablation, dual_clip_c=loss_cfg.dual_clip_c,
            behav_weight_lower=loss_cfg.behav_weight_lower, neg_behav_clip=loss_cfg.neg_behav_clip,
        )
        seq_index = mb.seq_index().to(dev)
        seq_counts = mb.seq_loss_tokens().to(dev)
        # Normalise by the response mask (fixed before the step), not the post-masking one,
        # so tokens dropped for a large behaviour weight contribute 0 rather than re-weighting the rest.
        pg = aggregate(terms.loss, mask, seq_index, agg=loss_cfg.agg, seq_token_counts=seq_counts,
                       denominator=denom)
        loss = pg
        kl_sum = torch.zeros((), device=dev)
        if loss_cfg.kl_coef > 0 and mb.ref_logprobs is not None:
            kl = kl_k3(lp, mb.ref_logprobs.to(dev))
            kl_term = aggregate(kl, terms.mask, seq_index, agg=loss_cfg.agg, seq_token_counts=seq_counts,
                                denominator=denom)
            loss = loss + loss_cfg.kl_coef * kl_term
            kl_sum = (kl.detach() * mask).sum()
        with torch.no_grad():
            scored = rows.to(dev) + 1
            ent = token_entropy(logits.detach(), mb.temperature.to(dev)[scored])
            ent_sum = (ent * mask[scored]).sum()
            sums = torch.stack([
                loss.detach(), pg.detach(), kl_sum, terms.clipped.sum(), (terms.behav_weight * mask).sum(),
                terms.capped.sum(), terms.masked.sum(), ((prox - behav).abs() * mask).sum(), ent_sum,
                mask.sum(), torch.tensor(float(mb.num_seqs), device=dev), terms.dual_clipped.sum(),
                ((lp.detach() - prox).abs() * mask).sum(), ((lp.detach() - behav).abs() * mask).sum(),
                (adv.abs() * mask).sum(), ((adv == 0).to(mask.dtype) * mask).sum(), terms.behav_clipped.sum(),
            ]).double().cpu()
            w_max = (terms.behav_weight * mask).max().double().cpu().reshape(1)
        return loss, sums, w_max

    def _logprobs_with(self, forward: Any, batch: TrainBatch, *, scored: bool = False) -> torch.Tensor:
        """Per-token logprobs of `batch` (`compute_logprobs`); `scored`: of the loss's tokens
        only (the rest 0), the logits computed at those positions alone."""
        self._train_mode(False)
        out = torch.zeros(batch.num_tokens, dtype=torch.float32)
        offs = batch.offsets().tolist()
        for idx in self._plan(batch):
            self._pick_threads()
            if not idx:
                self._dummy_forward(forward)
                continue
            mb = batch.select(idx)
            rows = _scored_rows(mb) if scored else None
            lp = _shifted_logprobs(forward(mb, rows), mb, self.device, rows).float().cpu()
            mb_offs = mb.offsets().tolist()
            for j, s in enumerate(idx):
                out[offs[s]:offs[s + 1]] = lp[mb_offs[j]:mb_offs[j + 1]]
        return out

    def _plan(self, batch: TrainBatch) -> list[list[int]]:
        """Micro-batches of `batch`, the same count on every rank (FSDP all-gathers per forward)."""
        lens = batch.seq_lens.tolist()
        bins = pack_sequences(lens, self.train_cfg.token_budget)
        if self.world_size > 1:
            n = int(self._all_reduce(torch.tensor([float(len(bins))], dtype=torch.float64),
                                     op=dist.ReduceOp.MAX).item())
            if n > len(bins):
                bins = balanced_partition(lens, n)
        return bins

    def _all_reduce(self, t: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        if self.world_size == 1:
            return t
        buf = t.to(self._collective_device())
        dist.all_reduce(buf, op=op, group=self.group)
        return buf.to(t.device)

    def _collective_device(self) -> torch.device:
        return self.device

    def _sync_for_timing(self) -> None:
        """Wait for queued device work, so the optimizer's time is not billed to the next
        mini-batch's forward (CUDA runs kernels asynchronously; a CPU needs nothing)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _dummy_backward(self) -> None:
        logits = self._forward_logits(_one_token_batch())
        (logits.sum() * 0.0).backward()

    def _dummy_forward(self, forward: Any) -> None:
        forward(_one_token_batch())

    # ---- backend hooks ---------------------------------------------------------------------------

    @abstractmethod
    def _forward_logits(self, mb: TrainBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [N, V] of a packed micro-batch (no attention across sequences); with `rows`
        (packed positions), only theirs, [len(rows), V] in that order: the vocabulary's
        projection, softmax and their backward are most of a small model's step when every
        prompt position gets them (docs/design.md §10.45)."""

    def _ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not support kl_coef > 0")

    @abstractmethod
    def _train_mode(self, on: bool) -> None: ...

    @abstractmethod
    def _clip_grad(self, max_norm: float) -> torch.Tensor:
        """Clip the (already data-parallel reduced) gradient; return the pre-clip total norm."""

    @abstractmethod
    def _optimizer_step(self) -> None: ...

    @abstractmethod
    def _zero_grad(self) -> None: ...

    @abstractmethod
    def _scheduler_step(self) -> None: ...

    @abstractmethod
    def _current_lr(self) -> float: ...

    def _grad_sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Context for one micro-batch backward; DDP skips the all-reduce except on the last."""
        return contextlib.nullcontext()


def _one_token_batch() -> TrainBatch:
    z = torch.zeros(1)
    return TrainBatch(
        input_ids=torch.zeros(1, dtype=torch.int64), loss_mask=z, behav_logprobs=z, advantages=z,
        temperature=torch.ones(1), versions=torch.full((1,), -1), seq_lens=torch.ones(1, dtype=torch.int64),
        rewards=z, group_ids=["_dummy"],
    )


def _scored_rows(mb: TrainBatch) -> torch.Tensor:
    """The packed positions whose logits the loss reads: t - 1 for every token t in the loss
    (`loss_mask`), never across a sequence's start. Prompt positions score nothing."""
    scored = mb.loss_mask > 0
    scored[mb.offsets()[:-1]] = False
    return scored.nonzero().squeeze(1) - 1


def _shifted_logprobs(logits: torch.Tensor, mb: TrainBatch, dev: torch.device,
                      rows: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token logprobs [N] from packed logits: token t is scored by the logits at t-1.

    Sequence-first positions (predicted, if at all, from the previous sequence) are 0. With
    `rows` (`_scored_rows`), `logits` are those rows' only and the tokens after them get
    logprobs; every other token 0.
    """
    ids = mb.input_ids.to(dev)
    temp = mb.temperature.to(dev)
    if rows is not None:
        at = rows.to(dev) + 1
        lp = torch.zeros(mb.num_tokens, dtype=torch.float32, device=dev)
        return lp.index_put((at,), token_logprobs(logits, ids[at], temp[at]).float())
    lp = token_logprobs(logits[:-1], ids[1:], temp[1:])
    lp = torch.cat([torch.zeros(1, dtype=lp.dtype, device=dev), lp])
    first = torch.zeros(mb.num_tokens, dtype=torch.bool, device=dev)
    first[mb.offsets()[:-1].to(dev)] = True
    return torch.where(first, torch.zeros_like(lp), lp)
