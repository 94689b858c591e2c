"""The demo model shipped inside the package: Sangam's default when no model is given.

A small masked-diffusion model in the LLaDA layout (config keys and tensor names as
LLaDA-8B-Instruct's), trained from scratch by ``scripts/train_demo_model.py`` on the toy chat
tasks of :mod:`sangam.demo.tasks` it can learn in that budget (reversing, sorting, copying and
counting: ``DEMO_FAMILIES``) with a character-level tokenizer (:mod:`sangam.demo.tokenizer`).
Its prompts are chat-formatted (``tokenizer.apply_chat_template``); it answers in a few tokens,
so decode it with a small canvas, e.g.
``SamplingParams(max_tokens=DEMO_MAX_TOKENS, block_length=DEMO_BLOCK_LENGTH)``.
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "model"
DEMO_MAX_TOKENS = 24  # the response length it was trained with
DEMO_BLOCK_LENGTH = 8  # three blocks per response
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def demo_model_path() -> str:
    """The shipped demo checkpoint's directory; raises FileNotFoundError if files are missing."""
    missing = [f for f in REQUIRED_FILES if not (DEMO_MODEL_DIR / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the demo model is incomplete: {', '.join(missing)} missing in {DEMO_MODEL_DIR}. "
            "Reinstall sangam, or rebuild it with `python scripts/train_demo_model.py "
            "--out sangam/demo/model`, or pass a checkpoint directory as the model.")
    return str(DEMO_MODEL_DIR)
