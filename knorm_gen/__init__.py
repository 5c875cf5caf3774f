"""knorm_gen: mlx_lm generation with L2Norm key-norm KV-cache eviction."""

# Must run before anything imports mlx.core: MLX resolves BLAS symbols at load.
from .runtime import preload_blas as _preload_blas

_preload_blas()

from .cache import (  # noqa: E402
    CacheStats,
    KVMemory,
    L2NormKVCache,
    cache_stats,
    kv_memory,
    make_eviction_cache,
)
from .config import KEEP_MODES, EvictionConfig, GenerationConfig  # noqa: E402
from .generate import (  # noqa: E402
    GenerationResult,
    PromptTooLongError,
    generate_with_eviction,
    stream_with_eviction,
)
from .batched import (  # noqa: E402
    answer_questions,
    generate_batch_with_eviction,
    stream_batch_with_eviction,
)
from .models import load_model  # noqa: E402
from .runtime import runtime_info  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "KEEP_MODES",
    "CacheStats",
    "EvictionConfig",
    "GenerationConfig",
    "GenerationResult",
    "PromptTooLongError",
    "L2NormKVCache",
    "answer_questions",
    "generate_with_eviction",
    "generate_batch_with_eviction",
    "stream_batch_with_eviction",
    "load_model",
    "stream_with_eviction",
    "cache_stats",
    "kv_memory",
    "KVMemory",
    "make_eviction_cache",
    "runtime_info",
    "__version__",
]
