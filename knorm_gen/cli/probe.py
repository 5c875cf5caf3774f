"""``knorm-probe``: the key-norm / attention probe (:mod:`knorm_gen.tuning.probe`)."""

from __future__ import annotations

from ..tuning.probe import probe_cli


def probe_command() -> None:
    """``knorm-probe``: how well a low key norm predicts attention on a model, layer by layer."""
    probe_cli()
