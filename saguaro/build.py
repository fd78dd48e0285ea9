"""The one builder: the draft resolved to its kind, and every decoder built in one dispatch.

``resolve_draft`` reads ``LLM``'s ``draft=`` once, against the ``Config`` and the built target, and returns one
draft kind (``saguaro.drafts``): none (AR), the n-gram matcher, a draft model or an EAGLE-3 head.
``build_decoder`` then builds AR, SD or SSD over whichever kind it got, asking the kind (its taps, its
proposer, and in the speculator its runner and shipment) rather than which kind it is.

SSD's draft model named by a registry name or path is loaded by the speculator alone (its process maps the
same cached files): the engine checks its vocabulary and holds none of its weights. On the CPU the speculator
process starts before the target loads (``start_speculator_early``), so its start (a fresh interpreter, the
draft mapped with its packed arena) overlaps the target's load instead of following it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from saguaro.config import Config
from saguaro.drafts import Draft, ModelDraft, NgramDraft, NoDraft
from saguaro.engine.decoder import ARDecoder, Decoder
from saguaro.loading import LoadedModel, check_draft_vocabulary, load_config
from saguaro.loading.place import load_or_place
from saguaro.loading.tokenizer import check_shared_vocabulary
from saguaro.target import Target

if TYPE_CHECKING:  # hints only
    from saguaro.engine.k_schedule import KSchedule
    from saguaro.ssd.plan import SpecPlan
    from saguaro.ssd.worker import WorkerLink


@dataclass
class EarlySpeculator:
    """SSD's speculator started before the target loads, with the plan it was given and the rounds' schedule
    (resolved once, here: the decoder built later uses the same)."""
    link: WorkerLink
    plan: SpecPlan
    schedule: KSchedule


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
    if cfg.mode == "ssd" and isinstance(draft, str):  # the speculator loads it: the engine needs no weights of it
        check_draft_vocabulary(draft, target.loaded.tokenizer)
        return ModelDraft(name=draft)
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


def start_speculator_early(cfg: Config, target: str | LoadedModel, draft: str | LoadedModel | None,
                           ) -> EarlySpeculator | None:
    """SSD's speculator process, started before the target loads, or None where it must wait: on a GPU it
    starts once the target's graphs are captured (one capture at a time), an EAGLE-3 head reads the target's
    embeddings, a draft in memory is shipped as a model kind, and tensor-parallel ranks start with the target.

    The plan needs only the target's vocabulary size (its config). The draft is located first, so that a
    bad name fails here and a first load converts it once, before the worker maps it."""
    on_cpu = cfg.device == "cpu" and (cfg.draft_device or cfg.device) == "cpu"
    if (cfg.mode != "ssd" or cfg.speculator_transport != "process" or not on_cpu or cfg.tensor_parallel_size > 1
            or not isinstance(draft, str) or _eagle_head_dir(cfg, draft) is not None):
        return None
    from saguaro.ssd.host import SpeculatorOptions
    from saguaro.ssd.worker import WorkerLink
    load_config(draft)
    vocab = (load_config(target) if isinstance(target, str) else target.config).vocab_size
    plan, schedule = _ssd_plan(cfg, vocab)
    link = WorkerLink(ModelDraft(name=draft), SpeculatorOptions.from_config(cfg, plan), cfg.device, wait=False)
    return EarlySpeculator(link, plan, schedule)


def build_decoder(cfg: Config, target: Target, draft: Draft, early: EarlySpeculator | None = None) -> Decoder:
    """AR, SD or SSD (``cfg.mode``) over ``target`` and ``draft`` (and SSD's speculator, if started early). The
    target's graphs are captured first, with the taps the draft reads, before any speculator starts (one capture
    at a time)."""
    runner = target.runner
    runner.capture_graphs(cfg.graph_rows, taps=draft.taps)
    if cfg.mode == "ar":
        return ARDecoder(runner)
    # each request's K per round (adaptive unless cfg.adaptive is off); SSD's cache tree per round too
    from saguaro.adapt.build import k_schedule
    if cfg.mode == "sd":
        from saguaro.sd.sd import SDDecoder
        return SDDecoder(runner, draft.proposer(cfg, runner, runner.blocks.num_blocks), cfg.num_speculative_tokens,
                         target.max_model_len, k_schedule(cfg))
    from saguaro.ssd.host import SpeculatorOptions
    from saguaro.ssd.ssd_decoder import SSDDecoder
    from saguaro.ssd.target_features import TargetFeatures
    # a draft that reads the target's features (an EAGLE-3 head) taps them before the speculator's first message
    features = TargetFeatures(runner, draft.taps) if draft.taps else None
    if early is not None:  # started early, its plan and schedule resolved then: its draft loaded beside the target
        plan, schedule, link = early.plan, early.schedule, early.link
        link.wait_ready()
    else:
        plan, schedule = _ssd_plan(cfg, runner.config.vocab_size)
        opts = SpeculatorOptions.from_config(cfg, plan)
        if cfg.speculator_transport == "thread":
            from saguaro.ssd.thread_link import ThreadLink
            link = ThreadLink(draft, opts)
        else:
            from saguaro.ssd.worker import WorkerLink
            link = WorkerLink(draft, opts, cfg.device)
    return SSDDecoder(runner, link, plan, target.max_model_len, features, schedule)


def _ssd_plan(cfg: Config, vocab_size: int):
    """SSD's plan and each round's schedule (adaptive: the plan gains the cache trees the schedule picks from,
    fixed here, before the speculator gets the plan)."""
    from saguaro.adapt.build import ssd_schedule
    from saguaro.calibration.resolve import ssd_plan
    return ssd_schedule(cfg, ssd_plan(cfg, vocab_size))
