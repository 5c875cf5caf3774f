"""knorm_gen: mlx_lm generation with KV-cache eviction (the L2Norm rule, KeyDiff and more on one machinery) that never evicts the instructions."""

# Must run before anything imports mlx.core: MLX resolves BLAS symbols at load.
from .runtime import preload_blas as _preload_blas

_preload_blas()

from .cache import BatchL2NormKVCache, L2NormKVCache, make_eviction_cache, probe_caches  # noqa: E402
from .config import KEEP_MODES, EvictionConfig, GenerationConfig, ResolvedEviction  # noqa: E402
from .generate import (  # noqa: E402
    answer_questions,
    generate_batch_with_eviction,
    generate_with_eviction,
    stream_batch_with_eviction,
    stream_with_eviction,
)
from .memory import CacheStats, KVMemory, cache_stats, kv_memory  # noqa: E402
from .models import load_model  # noqa: E402
from .prompts import PromptTooLongError  # noqa: E402
from .results import GenerationResult  # noqa: E402
from .runtime import runtime_info  # noqa: E402

__version__ = "0.12.0"

__all__ = [
    "KEEP_MODES",
    "BatchL2NormKVCache",
    "CacheStats",
    "EvictionConfig",
    "GenerationConfig",
    "GenerationResult",
    "KVMemory",
    "L2NormKVCache",
    "PromptTooLongError",
    "ResolvedEviction",
    "answer_questions",
    "cache_stats",
    "generate_batch_with_eviction",
    "generate_with_eviction",
    "kv_memory",
    "load_model",
    "make_eviction_cache",
    "probe_caches",
    "runtime_info",
    "stream_batch_with_eviction",
    "stream_with_eviction",
    "__version__",
]
