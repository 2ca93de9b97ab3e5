"""Models: configuration, weight loaders, tokenizer, the model as a graph, its KV cache and executor."""

from dtorch.models.bucket import Bucket as Bucket, bucket_for as bucket_for
from dtorch.models.config import PRESETS as PRESETS, ModelConfig as ModelConfig, rope_inv_freq as rope_inv_freq
from dtorch.models.default import default_model_path as default_model_path
from dtorch.models.executor import Executor as Executor, StepPlan as StepPlan
from dtorch.models.kv_cache import KVCache as KVCache
from dtorch.models.layout import Layout as Layout
from dtorch.models.loaders import (
    Checkpoint as Checkpoint,
    LazyCheckpoint as LazyCheckpoint,
    load_checkpoint as load_checkpoint,
    open_checkpoint as open_checkpoint,
)
from dtorch.models.model import Transformer as Transformer
from dtorch.models.tokenizer import StreamDecoder as StreamDecoder, Tokenizer as Tokenizer

__all__ = ["PRESETS", "Bucket", "Checkpoint", "Executor", "KVCache", "Layout", "LazyCheckpoint", "ModelConfig",
           "StepPlan", "StreamDecoder", "Tokenizer", "Transformer", "bucket_for", "default_model_path",
           "load_checkpoint", "open_checkpoint", "rope_inv_freq"]
