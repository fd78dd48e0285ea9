"""Train an EAGLE-3 head for a target from the target's own outputs (``saguaro train-head``).

Labels are the target's next-token distributions (top-k, ``data.label``) on teacher-forced text, restricted
to the draft vocabulary. EAGLE-3's training-time test: every example runs ``ttt_steps`` chained steps (7, as
EAGLE-3 trains), step j's loss weighted by ``STEP_DECAY ** j`` (0.8, EAGLE-3's) and the weighted losses summed. Step 0
reads the target's features; step j reads the head's own pre-norm hidden state from step j-1, as drafting
does. Row b of step j sits at position b+j, takes token x_{b+j+1}, sees the target-fed positions 0..b and its
own chain's earlier steps (the mask drafting produces), and is scored against the target's distribution at
position b+j+1.

Glossary: n = T-1 rows per example (bases b = 0..T-2); S = ttt_steps; V_d the draft vocabulary.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from saguaro.eagle.checkpoint import Eagle3Config, default_taps, save_eagle3
from saguaro.eagle.data import Example
from saguaro.eagle.head import Eagle3Head, layer_config
from saguaro.kv.kv_cache import KVCache
from saguaro.kv.metadata import build_metadata
from saguaro.models.transformer import CausalLM


STEP_DECAY = 0.8  # EAGLE-3's weight ratio between chained steps: later steps count less, as they are reached less


@dataclass
class TrainSettings:
    ttt_steps: int = 7
    lr: float = 5e-4
    steps: int = 200  # optimizer steps (one example each)
    minutes: float | None = None  # stop training after this long (the labels' time not counted)
    checkpoint_every: int = 50
    seed: int = 0


def new_head(target: CausalLM, draft_ids: torch.Tensor, seed: int = 0) -> Eagle3Head:
    """A float32 head shaped like one target layer, sharing the target's embedding; its LM head and final norm
    start from the target's rows for the draft vocabulary ``draft_ids``."""
    tc = target.config
    taps = default_taps(tc.num_layers)
    cfg = Eagle3Config(hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size, num_heads=tc.num_heads,
                       num_kv_heads=tc.num_kv_heads, head_dim=tc.head_dim, vocab_size=tc.vocab_size,
                       draft_vocab_size=len(draft_ids), rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta,
                       rope_scaling=tc.rope_scaling,
                       max_position_embeddings=tc.max_position_embeddings, target_hidden_size=tc.hidden_size,
                       taps=taps)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg, tc.hidden_size, taps, target.model.embed_tokens)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
        head.set_vocabulary(draft_ids)
        out = target.model.embed_tokens.weight if tc.tie_word_embeddings else target.lm_head.weight
        head.lm_head.weight.copy_(out[head.draft_ids].float())
        head.norm.weight.copy_(target.model.norm.weight.float())
    return head


def pick_vocabulary(examples: list[Example], size: int, vocab: int) -> torch.Tensor:
    """The ``size`` target ids the target predicts (argmax) or reads most often in ``examples``."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for ex in examples:
        counts += torch.bincount(torch.cat([ex.top_ids[:, 0], ex.tokens]), minlength=vocab)
    return counts.topk(min(size, vocab)).indices.sort().values


def _chain_mask(n: int, step: int) -> torch.Tensor:
    """[n, n*(step+1)]: row b sees target-fed positions 0..b, and its own rows of steps 1..step."""
    rows = torch.arange(n)
    fed = torch.arange(n)[None, :] <= rows[:, None]
    own = torch.eye(n, dtype=torch.bool)
    return torch.cat([fed] + [own] * step, 1)


def ttt_forward(head: Eagle3Head, ex: Example, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per step j: draft logits [n, V_d] and the label rows' positions [n] (b + j + 1, past T-1 is invalid)."""
    tokens, n = ex.tokens, len(ex.tokens) - 1
    cache = KVCache(layer_config(head.config), n * steps, 1, torch.float32)
    if torch.is_grad_enabled():  # a non-leaf cache, so that the k/v writes are recorded for backward
        cache.data = cache.data.requires_grad_().clone()
    feature = head.project(ex.features[:n])
    base = torch.arange(n)
    logits, label_pos = [], []
    for j in range(steps):
        slots = list(range(n * (j + 1)))
        meta = build_metadata([slots], [n]) if j == 0 else build_metadata([slots], [n], [_chain_mask(n, j)])
        pos = base + j + 1
        ids = tokens[pos.clamp(max=n)]
        feature = head(ids, base + j, feature, cache, meta)
        logits.append(head.logits(feature))
        label_pos.append(pos)
    return logits, label_pos


def ttt_loss(head: Eagle3Head, ex: Example, steps: int, to_draft: torch.Tensor
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(soft cross-entropy of each step weighted by ``STEP_DECAY ** j`` and summed, per step [n] bool: draft argmax
    == target argmax, invalid rows False). ``to_draft`` [V] maps target ids to draft ids (-1 outside)."""
    logits, label_pos = ttt_forward(head, ex, steps)
    n = len(ex.tokens) - 1
    losses, hits = [], []
    for step_logits, pos in zip(logits, label_pos):
        valid = pos <= n
        at = pos.clamp(max=n)
        draft = to_draft[ex.top_ids[at]]  # [n, k]
        mass = torch.where(draft >= 0, ex.top_probs[at], 0.0)
        target = torch.zeros_like(step_logits).scatter_add_(1, draft.clamp(min=0), mass)
        valid &= target.sum(1) > 0
        target = target / target.sum(1, keepdim=True).clamp(min=1e-9)
        row_loss = -(target * F.log_softmax(step_logits, -1)).sum(1)
        losses.append(row_loss[valid].mean() if valid.any() else step_logits.sum() * 0)
        hits.append(valid & (head.draft_ids[step_logits.argmax(1)] == ex.top_ids[at, 0]))
    weights = STEP_DECAY ** torch.arange(len(losses), dtype=torch.float32)
    return (weights * torch.stack(losses)).sum(), hits


@torch.no_grad()
def evaluate(head: Eagle3Head, examples: list[Example], steps: int) -> dict:
    """Held-out agreement: per step, how often the draft's argmax is the target's; and the mean length of
    the agreeing prefix of each chain (the drafts a greedy round would accept when the text is the target's
    own greedy continuation)."""
    to_draft = draft_index(head)
    agree = torch.zeros(steps)
    prefix, rows = 0.0, 0
    for ex in examples:
        _, hits = ttt_loss(head, ex, steps, to_draft)
        n = len(ex.tokens) - 1
        agree += torch.stack([h.float().sum() for h in hits])
        run = torch.ones(n, dtype=torch.bool)
        for h in hits:
            run &= h
            prefix += float(run.sum())
        rows += n
    return {"per_step_agreement": (agree / max(rows, 1)).tolist(), "accepted_per_round": prefix / max(rows, 1),
            "tokens": rows}


def draft_index(head: Eagle3Head) -> torch.Tensor:
    to_draft = torch.full((head.config.vocab_size,), -1, dtype=torch.long)
    to_draft[head.draft_ids] = torch.arange(head.config.draft_vocab_size)
    return to_draft


def train(head: Eagle3Head, examples: list[Example], settings: TrainSettings, out: Path, progress=None) -> dict:
    """Optimize ``head`` on ``examples`` (one per step, cycling), checkpointing to ``out/trainer.pt`` and
    ``out/head/`` every ``checkpoint_every`` steps; resumes from ``out/trainer.pt`` when it exists."""
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    state_path = out / "trainer.pt"
    step = 0
    if state_path.exists():
        saved = torch.load(state_path, weights_only=False)
        head.load_state_dict(saved["head"])
        opt.load_state_dict(saved["optimizer"])
        step = saved["step"]
    to_draft = draft_index(head)
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(settings.seed))
    started = time.monotonic()
    if progress is not None:
        progress.update(step)
    while step < settings.steps:
        if settings.minutes is not None and time.monotonic() - started > settings.minutes * 60:
            break
        lr = settings.lr * min(1.0, (step + 1) / 20)  # a short warm-up
        for group in opt.param_groups:
            group["lr"] = lr
        loss, _ = ttt_loss(head, examples[int(order[step % len(examples)])], settings.ttt_steps, to_draft)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{loss.item():.3f}")
        if step % settings.checkpoint_every == 0 or step == settings.steps:
            save_checkpoint(head, opt, step, settings, out)
    save_checkpoint(head, opt, step, settings, out)
    return {"steps": step, "seconds": time.monotonic() - started}


def save_checkpoint(head: Eagle3Head, opt, step: int, settings: TrainSettings, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(), "step": step,
                "settings": asdict(settings)}, out / "trainer.tmp")
    (out / "trainer.tmp").replace(out / "trainer.pt")  # a kill mid-write leaves the last checkpoint whole
    save_eagle3(out / "head", head.config, head.state_dict())
