"""The command line, one module per command: ``knorm-batch`` (:mod:`.batch`), ``knorm-generate``
(:mod:`.generate`), ``knorm-tune`` (:mod:`.tune`) and ``knorm-probe`` (:mod:`.probe`). Each parses
its options and calls the library. The options every command shares are generated from the config
fields (:mod:`.options`); ``knorm-batch --job FILE`` reads job files (:mod:`.job_file`).
``tests/test_cli.py`` checks that every field is reachable from the options and job files.
mlx_lm's names work too: ``--temp``, ``-m`` (``--max-tokens``), ``--ignore-chat-template``
(``--no-chat``), ``--extra-eos-token``, ``--chat-template-config``, ``--adapter-path``,
``--trust-remote-code``, ``--verbose True|False``; ``--max-kv-size`` is refused with the name of the
settings that bound the cache here (``--budget``, ``--ratio``).
"""

from .batch import batch_command, main
from .generate import generate_command
from .probe import probe_command
from .tune import tune_command

__all__ = ["batch_command", "generate_command", "main", "probe_command", "tune_command"]
