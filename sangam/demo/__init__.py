"""The demo models shipped inside the package: ``sangam-demo``, Sangam's default when no model
is given (``--model sangam-demo`` names it), and ``sangam-demo-long``, whose answers span many
blocks (below).

A small masked-diffusion model in the LLaDA layout (config keys and tensor names as
LLaDA-8B-Instruct's), trained from scratch by ``scripts/train_demo_model.py`` on the toy chat
tasks of :mod:`sangam.demo.tasks` it can learn in that budget (reversing, sorting, copying and
counting: ``DEMO_FAMILIES``) with a character-level tokenizer (:mod:`sangam.demo.tokenizer`).
Its prompts are chat-formatted (``tokenizer.apply_chat_template``); it answers in a few tokens,
so decode it with a small canvas, e.g.
``SamplingParams(max_tokens=DEMO_MAX_TOKENS, block_length=DEMO_BLOCK_LENGTH)`` (its
``generation_config.json`` says so too).

``sangam-demo-long`` is the same architecture and tokenizer trained (``--preset long``) on the
long task families (``LONG_FAMILIES``: copying, Caesar-shifting and tallying 64-150-character
strings): a 160-token canvas of 16-token blocks, answers over 4-10 of them, later blocks
depending on earlier ones (a tally) and on a long prompt. It is the testbed of what the speed
knobs (thresholds, caches, refresh cadences) cost in quality.

``sangam-demo-gemma`` is uniform-state diffusion in DiffusionGemma's layout (transformers'
config, Gemma-layout tokenizer), trained by ``scripts/train_demo_gemma.py`` on the short
tasks: one 24-token canvas per answer, re-sampled every step (its generation_config.json sets
the denoising options). ``sangam-bench quality --model sangam-demo-gemma`` sweeps its
``entropy_bound`` and ``max_denoising_steps``.
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "model"
DEMO_LONG_MODEL_DIR = Path(__file__).resolve().parent / "model_long"
DEMO_GEMMA_MODEL_DIR = Path(__file__).resolve().parent / "model_gemma"
DEMO_MODELS = {"sangam-demo": DEMO_MODEL_DIR, "sangam-demo-long": DEMO_LONG_MODEL_DIR,
               "sangam-demo-gemma": DEMO_GEMMA_MODEL_DIR}
DEMO_MAX_TOKENS = 24  # the response length it was trained with
DEMO_BLOCK_LENGTH = 8  # three blocks per response
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def demo_model_path(name: str = "sangam-demo") -> str:
    """A shipped demo checkpoint's directory; raises FileNotFoundError if files are missing."""
    path = DEMO_MODELS[name]
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the demo model {name} is incomplete: {', '.join(missing)} missing in {path}. "
            "Reinstall sangam, or rebuild it with `python scripts/train_demo_model.py "
            f"--out {path}`, or pass a checkpoint directory as the model.")
    return str(path)
