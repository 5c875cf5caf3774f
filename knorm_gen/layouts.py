"""The candidate layouts ``knorm-tune`` measures (:data:`CANDIDATES`), apart from the
tuner so the CLI can list them without loading it."""

from __future__ import annotations

from .config import OLD_RECENT_SHARE

_OLD = OLD_RECENT_SHARE  # the recent window every layout had before recent_share (budget // 8)
CANDIDATES: dict[str, dict] = {
    "keydiff": dict(keep="keydiff", skip_layers=(), coverage=0.0, recent_share=_OLD),
    "low": dict(keep="low", skip_layers=(), coverage=0.0, recent_share=_OLD),
    "blend": dict(keep="blend", early_keep="blend", skip_layers=(), coverage=0.0, recent_share=_OLD),
    "low_cov25": dict(keep="low", skip_layers=(), coverage=0.25, recent_share=_OLD),
    "low_cov50": dict(keep="low", skip_layers=(), coverage=0.5, recent_share=_OLD),
    "keydiff_cov25": dict(keep="keydiff", skip_layers=(), coverage=0.25, recent_share=_OLD),
    "keydiff_cov50": dict(keep="keydiff", skip_layers=(), coverage=0.5, recent_share=_OLD),
    "blend_cov25": dict(keep="blend", early_keep="blend", skip_layers=(), coverage=0.25, recent_share=_OLD),
    "blend_cov50": dict(keep="blend", early_keep="blend", skip_layers=(), coverage=0.5, recent_share=_OLD),
    "blend_cov75": dict(keep="blend", early_keep="blend", skip_layers=(), coverage=0.75, recent_share=_OLD),
    "leverage": dict(keep="leverage", skip_layers=(), coverage=0.0, recent_share=_OLD),
    "leverage_cov25": dict(keep="leverage", skip_layers=(), coverage=0.25, recent_share=_OLD),
    # half of each budget as the most recent tokens (recent_share=0.5), a quarter spread evenly, the rest by the rule
    "blend_cov25_rec50": dict(keep="blend", early_keep="blend", skip_layers=(), coverage=0.25, recent_share=0.5),
    # 0.5's and 0.6's default (--preset intrinsic): leverage in the first 30% of the full-attention layers, the blend
    # in the rest
    "lev30_blend_cov25_rec50": dict(keep="blend", early_keep="leverage", skip_layers=(), coverage=0.25,
                                    recent_share=0.5),
    "keydiff_cov25_rec50": dict(keep="keydiff", skip_layers=(), coverage=0.25, recent_share=0.5),
    "low_cov25_rec50": dict(keep="low", skip_layers=(), coverage=0.25, recent_share=0.5),
    "leverage_cov25_rec50": dict(keep="leverage", skip_layers=(), coverage=0.25, recent_share=0.5),
    "retrieval": dict(keep="low", skip_layers=None, coverage=0.0, recent_share=_OLD),  # first 30% whole: unbounded
    "retrieval_cov25": dict(keep="low", skip_layers=None, coverage=0.25, recent_share=_OLD),  # unbounded
    "paper": dict(keep="low", skip_layers=(0, 1), coverage=0.0, recent_share=_OLD),  # unbounded
    # the job's instructions probed before the document is read (knorm_gen.question), the recent eighth, no coverage
    "question": dict(keep="question", early_keep="question", skip_layers=(), coverage=0.0, recent_share=_OLD),
    # the question rule with a quarter (0.7-0.9's default) or half of each budget recent, and behind leverage in
    # the first 30% of the full-attention layers (measured in 0.6.1, docs/results.md)
    "question_rec25": dict(keep="question", early_keep="question", skip_layers=(), coverage=0.0, recent_share=0.25),
    # the same with each probe query's own local mean taken out first (0.9.2): more keys on Gemma 3, fewer on SmolLM2
    "question_per_query_rec25": dict(keep="question_per_query", early_keep="question_per_query", skip_layers=(),
                                     coverage=0.0, recent_share=0.25),
    # the same with a quarter of each later layer's rule slots carried from the earlier layers' best (the default
    # in 0.10; question_per_query_carry_rec25: the per-query rule so, 0.11's default)
    "question_carry_rec25": dict(keep="question_carry", early_keep="question_carry", skip_layers=(), coverage=0.0,
                                 recent_share=0.25),
    "question_per_query_carry_rec25": dict(keep="question_per_query_carry", early_keep="question_per_query_carry",
                                           skip_layers=(), coverage=0.0, recent_share=0.25),
    # the mean of the two rules' scores, carrying (the default since 0.12; docs/results.md)
    "question_both_carry_rec25": dict(keep="question_both_carry", early_keep="question_both_carry", skip_layers=(),
                                      coverage=0.0, recent_share=0.25),
    "question_rec50": dict(keep="question", early_keep="question", skip_layers=(), coverage=0.0, recent_share=0.5),
    "lev30_question": dict(keep="question", early_keep="leverage", skip_layers=(), coverage=0.0, recent_share=_OLD),
    "random": dict(keep="random", skip_layers=(), coverage=0.0, recent_share=_OLD),  # the control at equal bytes
}
"""Candidate layouts, each a set of :class:`EvictionConfig` fields (the budget is
the task's). ``random`` is every candidate's equal-bytes control."""
