"""The one builder: the draft resolved to its kind, and every decoder built in one dispatch.

``resolve_draft`` reads ``LLM``'s ``draft=`` once, against the ``Config`` and the built target, and returns one
draft kind (``saguaro.drafts``): none (AR), the n-gram matcher, a draft model or an EAGLE-3 head.
``build_decoder`` then builds AR, SD or SSD over whichever kind it got, asking the kind (its taps, its
proposer, and in the speculator its runner and shipment) rather than which kind it is.
"""
from __future__ import annotations

from saguaro.config import Config
from saguaro.drafts import Draft, ModelDraft, NgramDraft, NoDraft
from saguaro.engine.decoder import ARDecoder, Decoder
from saguaro.loading import LoadedModel
from saguaro.loading.place import load_or_place
from saguaro.loading.tokenizer import check_shared_vocabulary
from saguaro.target import Target


def resolve_draft(draft: str | LoadedModel | None, cfg: Config, target: Target) -> Draft:
    """The draft kind of ``draft`` (a registry name or path, an EAGLE-3 head's directory, a ``LoadedModel``)."""
    if cfg.mode == "ar":
        return NoDraft()
    if cfg.mode == "sd" and cfg.proposer == "ngram":
        return NgramDraft()
    head_dir = _eagle_head_dir(cfg, draft)
    if head_dir is not None:  # the head, and what it reads of the target (shared, not copied, by a thread)
        from saguaro.eagle.draft import EagleDraft
        return EagleDraft(head_dir, target.loaded.config, target.embeddings())
    loaded = load_or_place(draft, cfg.draft_device or cfg.device, cfg.draft_torch_dtype)
    check_shared_vocabulary(target.loaded.tokenizer, loaded.tokenizer)
    return ModelDraft(loaded, draft if isinstance(draft, str) else None)


def _eagle_head_dir(cfg: Config, draft: str | LoadedModel | None) -> str | None:
    """The EAGLE-3 head directory that drafts, if the draft is one (``draft_kind``)."""
    if cfg.proposer != "draft" or cfg.draft_kind == "model" or not isinstance(draft, str):
        if cfg.draft_kind == "eagle3" and not isinstance(draft, str):
            raise ValueError("draft_kind='eagle3' needs the head's directory as draft=")
        return None
    from saguaro.eagle.checkpoint import is_eagle3_dir
    if cfg.draft_kind == "eagle3" or is_eagle3_dir(draft):
        cfg.check_eagle3(f"the EAGLE-3 head {draft}")
        return draft
    return None


def build_decoder(cfg: Config, target: Target, draft: Draft) -> Decoder:
    """AR, SD or SSD (``cfg.mode``) over ``target`` and ``draft``. The target's graphs are captured first, with
    the taps the draft reads, before any speculator starts (one capture at a time)."""
    runner = target.runner
    runner.capture_graphs(cfg.graph_rows, taps=draft.taps)
    if cfg.mode == "ar":
        return ARDecoder(runner)
    # each request's K per round (adaptive unless cfg.adaptive is off); SSD's cache tree per round too
    from saguaro.adapt.build import k_schedule, ssd_schedule
    if cfg.mode == "sd":
        from saguaro.sd.sd import SDDecoder
        return SDDecoder(runner, draft.proposer(cfg, runner, runner.blocks.num_blocks), cfg.num_speculative_tokens,
                         target.max_model_len, k_schedule(cfg))
    from saguaro.calibration.resolve import ssd_plan
    from saguaro.ssd.host import SpeculatorOptions
    from saguaro.ssd.ssd_decoder import SSDDecoder
    from saguaro.ssd.target_features import TargetFeatures
    # adaptive: the plan gains the cache trees the schedule picks from per round, before the speculator gets it
    plan, schedule = ssd_schedule(cfg, ssd_plan(cfg, runner.config.vocab_size))
    opts = SpeculatorOptions.from_config(cfg, plan)
    # a draft that reads the target's features (an EAGLE-3 head) taps them before the speculator's first message
    features = TargetFeatures(runner, draft.taps) if draft.taps else None
    if cfg.speculator_transport == "thread":
        from saguaro.ssd.thread_link import ThreadLink
        link = ThreadLink(draft, opts)
    else:
        from saguaro.ssd.worker import WorkerLink
        link = WorkerLink(draft, opts, cfg.device)
    return SSDDecoder(runner, link, plan, target.max_model_len, features, schedule)
