"""The BPE pre-tokenizers of llama.cpp 0.3.36 (``src/llama-vocab.cpp``): each ``tokenizer.ggml.pre`` name it knows, the
regexes its pre-tokenizer type splits text with, and the flags the name sets.

llama.cpp splits a text with the first regex, each piece again with the next, and so on; a match and the text between
two matches are pieces of their own (``tokenizers``' "isolated" split). Its regexes run on a "collapsed" text where
every character past ASCII stands for its Unicode category, so ``\\p{Lu}``, ``\\p{Ll}`` ... all mean any letter there;
``_collapse`` writes that into the regexes. Where llama.cpp swaps a regex for a hand-written splitter (Kimi-K2,
AFMoE's digits), the regex here is the one that splitter implements.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# digits in groups of three counted from the right (llama.cpp's AFMoE splitter, used for tiny_aya and superbpe too)
_DIGITS_BY_THREE = r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"
_DEEPSEEK_LETTERS = (
    r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝ"
    r"Ὗ-\x{1F7D}ᾀ-ᾴᾶ-ᾼ\x{1FBE}ῂ-ῄῆ-ῌῐ-\x{1FD3}ῖ-\x{1FDB}ῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\x{2126}ℨ\x{212A}-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+")
_CJK_KOREAN = r"[一-龥ࠀ-一가-\x{D7FF}]+"  # CJK, Samaritan to CJK, Hangul
_CJK_KANA = r"[一-龥\x{3040}-ゟ゠-ヿ]+"  # CJK, hiragana, katakana
_HUNYUAN_TAIL = (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
                 r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CASED = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS + "?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?")
_UPPER_LOWER = (r"[^\r\n\p{{L}}\p{{N}}]?((?=[{c}])([^a-z]))*((?=[{c}])([^A-Z]))+{k}"
                r"|[^\r\n\p{{L}}\p{{N}}]?((?=[{c}])([^a-z]))+((?=[{c}])([^A-Z]))*{k}")
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
_NEWLINES = r"[^\n]+|[\n]+"

# pre-tokenizer type (llama.cpp's LLAMA_VOCAB_PRE_TYPE_*, lower case) -> its regexes, in order
SPLITS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "llama3": (_LLAMA3,),
    "jais2": (_LLAMA3.replace(r"|\s+(?!\S)|\s+", "") + "".join(rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32,
                                                                                                 16, 8, 4))
              + r"|\s{1,2}(?!\S)|\s{1}",),
    "dbrx": (_LLAMA3,),
    "deepseek_llm": (r"[\r\n]", _DEEPSEEK_LETTERS, r"\s?[!-/:-~！-／：-～‘-‟\x{3000}-。]+", r"\s+$", _CJK_KOREAN,
                     r"\p{N}+"),
    "deepseek3_llm": (r"\p{N}{1,3}", _CJK_KANA, _HUNYUAN_TAIL),
    "spark2_5": (r"\p{N}{1,3}", _CJK_KANA, _HUNYUAN_TAIL.replace(r"[\r\n]*|\s*[\r\n]+", r"|[\r\n]"),
                 r"\p{N}"),
    "youtu": (r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥\x{3040}-ゟ゠-ヿ]+",
              _CASED + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "deepseek_coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_KOREAN, r"\p{N}"),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "starcoder": (r"\p{N}", _GPT2),
    "gpt2": (_GPT2,),
    "qwen2": (_QWEN2,),
    "qwen35": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+",),
    "bloom": (_BLOOM,),
    "chatglm4": (_LLAMA3,),
    "viking": (_BLOOM, r"\p{N}"),
    "tekken": (_UPPER_LOWER.format(c=r"\p{L}", k="")
               + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "chameleon": (r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
                  r"[\p{P}!-/:-@\[-`{-~]", _GPT2),
    "gpt4o": (_UPPER_LOWER.format(c=r"\p{L}", k=_CONTRACTIONS + "?")
              + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "granite_emb_multi": (_UPPER_LOWER.format(c=r"\p{L}\p{M}", k=_CONTRACTIONS + "?")
                          + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "tiny_aya": (_DIGITS_BY_THREE,
                 _CASED + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    # what llama.cpp's hand-written Kimi-K2 splitter does: Han runs, then runs of letters that are not Han
    "kimi_k2": (r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{L}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "superbpe": (r"\p{N}+", r"(?=([0-9]{3})+(?![0-9]))"),
    "bailingmoe": (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",),
    "seed_coder": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
                   r"|\s+(?!\S)|\s+",),
    "ufakzeka": (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "grok_2": (_QWEN2,),
    "afmoe": (_DIGITS_BY_THREE, r"[一-鿿㐀-䶿豈-\x{FAFF}\x{3040}-ゟ゠-ヿ･-ﾟ⼀-\x{2FDF}เ-\x{E7F}\x{E80}-"
              r"\x{EFF}ក-\x{17FF}က-႟ꩠ-ꩿꧠ-\x{A9FF}가-\x{D7AF}ᄀ-ᇿ]+", _HUNYUAN_TAIL),
    "laguna": (_NEWLINES, _QWEN2),
    "exaone_moe": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",),
    # SentencePiece-style BPE: spaces are "▁" (the normalizer's), merges run over whole lines of raw UTF-8
    "gemma4": (_NEWLINES,),
    "sarvam_moe": (_NEWLINES,),
    "minicpm5": (r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "whitespace": (r"\S+",),
}
# types whose pieces are raw UTF-8 (no GPT-2 byte alphabet): spaces as "▁", bytes as <0xNN> tokens
RAW_UTF8 = frozenset({"gemma4", "sarvam_moe", "whitespace"})


@dataclass(frozen=True, slots=True)
class Pre:
    """What one ``tokenizer.ggml.pre`` name means to llama.cpp: its pre-tokenizer ``type`` (a key of ``SPLITS``), and
    the flags the name sets: ``ignore_merges`` (a piece that is a token is that token, merges or not), ``add_bos``
    (the default of ``tokenizer.ggml.add_bos_token``), ``escape_spaces`` (spaces become "▁" before the merges)."""

    type: str
    ignore_merges: bool = False
    add_bos: bool = False
    escape_spaces: bool = False


_L3 = Pre("llama3", ignore_merges=True, add_bos=True)
# every name llama.cpp 0.3.36 maps (llama_vocab::impl::load); "" (no tokenizer.ggml.pre) is "default"
NAMES: dict[str, Pre] = {
    "": Pre("default"), "default": Pre("default"), "minicpm5": Pre("minicpm5", ignore_merges=True),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"), _L3),
    "deepseek-llm": Pre("deepseek_llm"), "deepseek-coder": Pre("deepseek_coder"),
    "deepseek-v3": Pre("deepseek3_llm"), "spark2_5": Pre("spark2_5"), "youtu": Pre("youtu", ignore_merges=True),
    "falcon": Pre("falcon"), "mpt": Pre("gpt2"), "starcoder": Pre("starcoder"),
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                     "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "olmo", "jais",
                     "trillion", "granite-docling"), Pre("gpt2")),
    "jais-2": Pre("jais2"),
    "gemma4": Pre("gemma4", escape_spaces=True), "granite-embed-multi-311m": Pre("gemma4", escape_spaces=True),
    "sarvam-moe": Pre("sarvam_moe", escape_spaces=True),
    "whitespace": Pre("whitespace"), "refact": Pre("starcoder"), "command-r": Pre("starcoder"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"),
                    Pre("qwen2")),
    "qwen35": Pre("qwen35"), "dbrx": Pre("dbrx"), "smaug-bpe": Pre("dbrx"), "poro-chat": Pre("bloom"),
    "chatglm-bpe": Pre("chatglm4"), "glm4": Pre("chatglm4", ignore_merges=True),
    "glm5": Pre("chatglm4", ignore_merges=True), "viking": Pre("viking"),
    "tekken": Pre("tekken", ignore_merges=True, add_bos=True),
    **dict.fromkeys(("smollm", "codeshell", "exaone", "minerva-7b", "mellum2"), Pre("starcoder")),
    "bloom": Pre("bloom"), "gpt3-finnish": Pre("bloom"), "exaone-moe": Pre("exaone_moe"),
    "chameleon": Pre("chameleon", add_bos=True),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), Pre("gpt4o")),
    "granite-embed-multi-97m": Pre("granite_emb_multi", ignore_merges=True),
    "tiny_aya": Pre("tiny_aya"), "cohere2moe": Pre("tiny_aya"), "superbpe": Pre("superbpe"),
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), Pre("bailingmoe")),
    "seed-coder": Pre("seed_coder"), "hunyuan-dense": Pre("deepseek3_llm"), "hy_v4": Pre("deepseek3_llm"),
    "joyai-llm": Pre("deepseek3_llm"), "kimi-k2": Pre("kimi_k2"), "ufakzeka": Pre("ufakzeka"),
    "grok-2": Pre("grok_2"), "afmoe": Pre("afmoe"), "laguna": Pre("laguna"),
}
_missing = {p.type for p in NAMES.values()} - SPLITS.keys()
assert not _missing, f"pre-tokenizer types without splits: {_missing}"

_CASE_CLASSES = re.compile(r"\\p\{L[ultmo]\}")


def splits(pre: Pre) -> list[str]:
    """The regexes of ``pre`` as ``tokenizers``' Onig runs them with llama.cpp's meaning."""
    return [_collapse(r) for r in SPLITS[pre.type]]


def _collapse(regex: str) -> str:
    """llama.cpp's collapsed categories: a letter of any case is ``\\p{L}`` (its ``\\p{Lu}`` matches "a")."""
    return _CASE_CLASSES.sub(r"\\p{L}", regex)
