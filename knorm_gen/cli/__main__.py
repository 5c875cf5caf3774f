"""``python -m knorm_gen.cli``: ``knorm-batch`` (what ``mlx.launch`` starts on each rank)."""

from .batch import main

main()
