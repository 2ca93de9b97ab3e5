"""Hugging Face directories: ``config.json`` + ``model.safetensors`` (or a sharded index) + tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dtorch.core.errors import ModelError
from dtorch.models.config import ModelConfig
from dtorch.models.loaders.checkpoint import Checkpoint, finish_tensors, progress


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _shards(directory: Path) -> list[Path]:
    single = directory / "model.safetensors"
    if single.exists():
        return [single]
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelError(f"{index}: expected a 'weight_map' object mapping tensor names to shard files")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (directory / f).exists()]
        if missing:
            raise ModelError(f"{index}: shard files {missing} named in the index do not exist in {directory}")
        return [directory / f for f in files]
    raise ModelError(f"{directory}: no weights found; expected model.safetensors or model.safetensors.index.json")


def _read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                keys = list(st.keys())
                for k in progress(keys, len(keys), f"loading {f.name}"):
                    tensors[k] = st.get_tensor(k)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise ModelError(f"{f}: not a readable safetensors file ({e}); expected a complete safetensors "
                             "file as written by safetensors.torch.save_file") from None
    return tensors


def _chat_template(directory: Path, tok_config: dict[str, Any]) -> str | None:
    jinja = directory / "chat_template.jinja"  # transformers 5 writes the template beside tokenizer_config.json
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def load_hf(directory: str | Path, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Load a Hugging Face model directory; the tokenizer is None when it has no ``tokenizer.json``."""
    from dtorch.models.tokenizer import Tokenizer

    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.exists():
        raise ModelError(f"{directory}: no config.json; expected a Hugging Face model directory or a .gguf file")
    cfg_json = _read_json(cfg_path)
    gen_path = directory / "generation_config.json"
    if gen_path.exists():  # generation stops at the union of both files' eos ids
        ids = [cfg_json.get("eos_token_id"), _read_json(gen_path).get("eos_token_id")]
        flat = [i for v in ids if v is not None for i in (v if isinstance(v, list) else [v])]
        cfg_json["eos_token_id"] = list(dict.fromkeys(flat)) or None
    config = ModelConfig.from_hf(cfg_json)
    tensors = finish_tensors(_read_safetensors(_shards(directory)), config, dtype, str(directory))

    tokenizer, template = None, None
    tok_config = _read_json(directory / "tokenizer_config.json") if (directory / "tokenizer_config.json").exists() \
        else {}
    template = _chat_template(directory, tok_config)
    if (directory / "tokenizer.json").exists():
        tokenizer = Tokenizer.from_hf(directory / "tokenizer.json", tok_config, chat_template=template,
                                      eos_token_ids=config.eos_token_ids)
    return Checkpoint(config=config, tensors=tensors, tokenizer=tokenizer, source=str(directory),
                      chat_template=template)
