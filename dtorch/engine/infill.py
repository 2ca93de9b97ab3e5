"""Fill-in-the-middle: the prompt of a code model asked for the text between a prefix and a suffix.

Code models are trained with three control tokens of their vocabulary around the two texts, prefix first ("PSM",
what llama.cpp's server writes): ``<|fim_prefix|>`` prefix ``<|fim_suffix|>`` suffix ``<|fim_middle|>``, and the model
writes the middle. The tokens are found by their spelling in the vocabulary (``FIM_TOKENS``, one row per naming);
the tokens that end a file or pad a middle are stop tokens of such a request.
"""

from __future__ import annotations

from typing import Any

from dtorch.core.errors import ArgumentError

# (prefix, suffix, middle) as each family's vocabulary spells them
FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder, Granite code
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),  # CodeLlama
    ("<PRE>", "<SUF>", "<MID>"),
)
# tokens after which a middle is done: padding, the next file, the next repository, CodeLlama's end of infill
FIM_ENDS = ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<file_sep>", "<fim_pad>", "▁<EOT>", "<EOT>")


def fim_tokens(tokenizer: Any) -> tuple[int, int, int] | None:
    """The ids of the vocabulary's (prefix, suffix, middle) tokens, or None when it has none."""
    for names in FIM_TOKENS:
        ids = [tokenizer.token_to_id(n) for n in names]
        if all(i is not None for i in ids):
            return ids[0], ids[1], ids[2]
    return None


def fim_prompt(tokenizer: Any, prefix: str, suffix: str) -> tuple[list[int], tuple[int, ...]]:
    """The prompt ids of a fill-in-the-middle request and the extra stop token ids that end its middle. Raises
    ``ArgumentError`` naming the known FIM tokens when the vocabulary has none of them."""
    ids = fim_tokens(tokenizer)
    if ids is None:
        known = ", ".join(" ".join(names) for names in FIM_TOKENS)
        e = ArgumentError(f"suffix: this model's vocabulary has no fill-in-the-middle tokens (known: {known}); "
                          "fill-in-the-middle needs a code model trained for it")
        e.param = "suffix"  # type: ignore[attr-defined]  # the request field at fault, for a server's answer
        raise e
    pre, suf, mid = ids
    head = tokenizer.encode("", add_special_tokens=True)  # the BOS the vocabulary puts first, if any
    head = head[:1] if head and head[0] == tokenizer.bos_token_id else []
    body = [pre, *tokenizer.encode(prefix, add_special_tokens=False), suf,
            *tokenizer.encode(suffix, add_special_tokens=False), mid]
    ends = tuple(i for n in FIM_ENDS if (i := tokenizer.token_to_id(n)) is not None)
    return head + body, ends
