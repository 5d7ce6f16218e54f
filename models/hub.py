"""Hugging Face hub ids (``HuggingFaceTB/SmolLM2-135M-Instruct``) -> a local snapshot folder,
through huggingface_hub's own resolution of its cache (``HF_HUB_CACHE`` / ``HF_HOME``),
offline when ``HF_HUB_OFFLINE=1``."""

from __future__ import annotations

import os
import re

# what rung reads of a snapshot (model folders: config, weights, tokenizer, generation
# config, chat template)
_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]
_REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")


def looks_like_repo_id(model: str) -> bool:
    """``org/name`` that is not a path on this machine (nor a .gguf file's name)."""
    return bool(_REPO_ID.fullmatch(model)) and not os.path.exists(model) \
        and not model.startswith(".") and not model.endswith(".gguf")


def resolve_repo_id(repo_id: str) -> str:
    """The local snapshot folder of ``repo_id``: from the cache first (no network), then,
    unless the hub is offline, downloaded. A ValueError says where rung looked and how to
    fetch it."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = constants.HF_HUB_CACHE
    try:
        return snapshot_download(repo_id, local_files_only=True,
                                 allow_patterns=_ALLOW_PATTERNS)
    except (LocalEntryNotFoundError, HFValidationError):
        pass
    if not constants.HF_HUB_OFFLINE:
        try:
            return snapshot_download(repo_id, allow_patterns=_ALLOW_PATTERNS)
        except Exception as e:          # network, auth, missing repo: all end the same way
            reason = f"downloading it failed ({type(e).__name__}: {e})"
    else:
        reason = "HF_HUB_OFFLINE=1, so rung did not try the network"
    raise ValueError(f"model {repo_id!r} is not in the Hugging Face cache {cache} and "
                     f"{reason}; fetch it on a machine with network access with "
                     f"`hf download {repo_id}` (same HF_HUB_CACHE / HF_HOME), or pass a "
                     "local folder or .gguf file")
