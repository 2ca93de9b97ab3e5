"""The engine: requests, the scheduler (continuous batching, chunked prefill, preemption), the paged block manager
with prefix caching, sampling, and ``LLM`` on top."""

from dtorch.engine.llm import LLM as LLM, GenerationStats as GenerationStats, RequestOutput as RequestOutput
from dtorch.engine.sampling import SamplingParams as SamplingParams
