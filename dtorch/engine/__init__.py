"""The engine: requests, the scheduler (continuous batching, chunked prefill, preemption), the paged block manager
with prefix caching, sampling, and ``LLM`` on top."""

from dtorch.engine.llm import LLM as LLM, GenerationStats as GenerationStats
from dtorch.engine.output_parser import ToolCall as ToolCall
from dtorch.engine.request import (
    CompletionOutput as CompletionOutput,
    Logprob as Logprob,
    RequestOutput as RequestOutput,
)
from dtorch.engine.sampling import SamplingParams as SamplingParams
from dtorch.engine.structured import StructuredOutputsParams as StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "GenerationStats", "Logprob", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams", "ToolCall"]
