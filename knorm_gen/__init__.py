"""knorm_gen: mlx_lm generation with KV-cache eviction that never evicts the instructions: the
question rule (the default), the paper's L2Norm rule and others on one machinery."""

# Must run before anything imports mlx.core: MLX resolves BLAS symbols at load.
from .platform.runtime import preload_blas as _preload_blas

_preload_blas()

from .eviction.cache import (BatchEvictionKVCache, EvictionKVCache,  # noqa: E402
                    make_eviction_cache, probe_caches)
from .eviction.config import KEEP_MODES, PRESETS, EvictionConfig, GenerationConfig, ResolvedEviction  # noqa: E402
from .generation.generate import (  # noqa: E402
    answer_questions,
    generate_batch_with_eviction,
    generate_with_eviction,
    stream_batch_with_eviction,
    stream_with_eviction,
)
from .eviction.memory import CacheStats, KVMemory, cache_stats, kv_memory  # noqa: E402
from .models.load import load_model  # noqa: E402
from .generation.prompts import PromptTooLongError  # noqa: E402
from .generation.results import GenerationResult  # noqa: E402
from .platform.runtime import runtime_info  # noqa: E402
from .models.support import ModelSupport, UnsupportedModelError, model_support  # noqa: E402
from .generation.tunings import NoTuningError, tuned_config  # noqa: E402

__version__ = "0.14.0"

__all__ = [
    "KEEP_MODES",
    "PRESETS",
    "BatchEvictionKVCache",
    "EvictionKVCache",
    "ModelSupport",
    "NoTuningError",
    "UnsupportedModelError",
    "CacheStats",
    "EvictionConfig",
    "GenerationConfig",
    "GenerationResult",
    "KVMemory",
    "PromptTooLongError",
    "ResolvedEviction",
    "answer_questions",
    "cache_stats",
    "generate_batch_with_eviction",
    "generate_with_eviction",
    "kv_memory",
    "load_model",
    "make_eviction_cache",
    "model_support",
    "probe_caches",
    "runtime_info",
    "stream_batch_with_eviction",
    "stream_with_eviction",
    "tuned_config",
    "__version__",
]
