"""The shipped demo model: its files, tokenizer and chat template, tasks, decoding, training."""

import dataclasses
import importlib.util
import json
import random
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sangam import LLM, SamplingParams
from sangam.demo import (
    DEMO_BLOCK_LENGTH,
    DEMO_MAX_TOKENS,
    DEMO_MODELS,
    demo_model_path,
)
from sangam.demo.tasks import (
    DEMO_FAMILIES,
    FAMILIES,
    FIELD,
    LONG_ANSWER,
    LONG_FAMILIES,
    SHIFTS,
    TALLY_LETTERS,
    VERB_WIDTH,
    eval_set,
    generate,
    sample_task,
    split_of,
    training_stream,
)
from sangam.demo.tokenizer import (
    EOS_ID,
    EOT_ID,
    MASK_ID,
    VOCAB_SIZE,
    chat_prompt,
    encode,
    write_tokenizer,
)
from sangam.models import load_model, load_tokenizer, read_config, stop_token_ids
from sangam.models.llada import LLaDAModel

ROOT = Path(__file__).resolve().parents[1]
LLADA_DEMOS = ("sangam-demo", "sangam-demo-long")  # DEMO_MODELS' masked-diffusion ones
# sangam-demo-gemma's share right at its defaults (`sangam-bench quality`: 97.5% of 240).
GEMMA_DEMO_MIN_RIGHT = 0.9


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_path(), local_files_only=True)


@pytest.fixture(scope="module")
def demo_llm():
    return LLM(device="cpu", dtype="float32")  # model=None: the demo model


@pytest.fixture(scope="module")
def trainer():
    spec = importlib.util.spec_from_file_location(
        "train_demo_model", ROOT / "scripts" / "train_demo_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_the_demos_are_the_two_llada_and_one_gemma():
    assert set(DEMO_MODELS) == {*LLADA_DEMOS, "sangam-demo-gemma"}


@pytest.mark.parametrize("name", LLADA_DEMOS)
def test_demo_checkpoint_loads_as_llada(tokenizer, name):
    path = demo_model_path(name)
    cfg = read_config(path)
    assert cfg.architecture == "LLaDAModelLM"
    assert (cfg.vocab_size, cfg.mask_token_id, cfg.eos_token_id) == (VOCAB_SIZE, MASK_ID, EOS_ID)
    model = load_model(path, "cpu", "float32")  # strict: every LLaDA tensor name, right shapes
    assert isinstance(model, LLaDAModel)
    assert tokenizer.mask_token_id == MASK_ID and tokenizer.eos_token_id == EOS_ID
    assert len(tokenizer) == VOCAB_SIZE
    assert stop_token_ids(cfg.eos_token_id, load_tokenizer(path)) == {EOS_ID, EOT_ID}


def test_loading_the_demo_is_quiet_and_skips_weight_init():
    """Loading builds the model on meta tensors without random init (which would import
    torch._dynamo, about a second) and prints no transformers warning about the model type."""
    code = ("import sys; from sangam.demo import demo_model_path; "
            "from sangam.models import load_model, load_tokenizer; "
            "load_model(demo_model_path()); load_tokenizer(demo_model_path()); "
            "print('torch._dynamo' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
    assert "model of type" not in proc.stderr, proc.stderr


def test_missing_demo_files_raise_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(DEMO_MODELS, "sangam-demo", tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        demo_model_path()
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(model="sangam-demo", device="cpu")  # by name


@pytest.mark.parametrize("name", list(DEMO_MODELS))
def test_shipped_tokenizer_files_match_the_code(tmp_path, name):
    model_dir = DEMO_MODELS[name]
    write_tokenizer(tmp_path, layout="gemma" if name == "sangam-demo-gemma" else "llada")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert json.loads((tmp_path / name).read_text()) == \
            json.loads((model_dir / name).read_text()), name


def test_chat_template_gives_the_training_prompt(tokenizer):
    messages = [{"role": "user", "content": "  What is 12+7? "}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == chat_prompt("What is 12+7?")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == encode(text)
    assert ids[0] == tokenizer.bos_token_id and ids.count(EOT_ID) == 1
    assert tokenizer.decode(ids) == text


def test_characters_round_trip_exactly(tokenizer):
    text = string.printable.replace("\t", "").replace("\r", "").replace("\x0b", "")
    text = text.replace("\x0c", "") + "  two  spaces \n\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids + [EOT_ID, EOS_ID], skip_special_tokens=True) == text


def test_task_generators_are_seeded_and_splits_disjoint():
    for family in FAMILIES:
        a = generate(family, 30, seed=3)
        assert a == generate(family, 30, seed=3)
        assert a != generate(family, 30, seed=4)
        assert all(t.family == family and split_of(t) == "eval" for t in a)
        assert all(split_of(t) == "train" for t in generate(family, 30, 3, "train"))
    stream = training_stream(seed=0)
    train = [next(stream) for _ in range(3000)]
    assert {t.family for t in train} == set(FAMILIES)
    held_out = {(t.family, t.prompt) for t in eval_set(100)}
    assert not held_out & {(t.family, t.prompt) for t in train}
    with pytest.raises(ValueError, match="unknown task family"):
        generate("divide", 1, 0)


def test_long_task_answers_are_right_and_span_four_to_ten_blocks():
    rng = random.Random(0)
    lengths = set()
    for _ in range(300):
        for family in LONG_FAMILIES:
            t = sample_task(family, rng)
            lengths.add(len(t.answer))
            assert LONG_ANSWER[0] <= len(t.answer) <= LONG_ANSWER[1]
            # Every family's field starts and ends at the same place, dots after the word, so
            # answer character j sits at one fixed distance from prompt character j.
            verb, field = t.prompt[:VERB_WIDTH], t.prompt[VERB_WIDTH:]
            assert len(field) == FIELD and t.prompt.strip() == t.prompt
            word = field.rstrip(".")
            assert set(field[len(word):]) <= {"."} and len(word) == len(t.answer)
            if family == "shift":
                k = int(verb.split()[1].rstrip(":"))
                assert k in SHIFTS and t.answer == "".join(
                    string.ascii_lowercase[(ord(c) - 97 + k) % 26] for c in word)
            elif family == "tally":
                assert set(word) <= set(TALLY_LETTERS)
                assert t.answer == "".join(str(word[:j + 1].count("a") % 10)
                                           for j in range(len(word)))
            else:
                assert t.answer == word
    # <|eot_id|> (index n of the response) lands in each of blocks 4..9 of 16 tokens: responses
    # span 5 to 10 of the 160-token canvas's blocks.
    assert {n // 16 for n in lengths} == set(range(4, 10))


def test_task_answers_are_right_and_short():
    rng = random.Random(0)
    for _ in range(500):
        for family in (f for f in FAMILIES if f not in LONG_FAMILIES):
            t = sample_task(family, rng)
            assert 1 <= len(t.answer) <= 8
            if family in ("add", "sub"):
                assert str(eval(t.prompt[len("What is "):-1])) == t.answer  # digits and +/- only
            elif family == "count":
                letter, word = t.prompt[len("How many "):-1].split("'s in ")
                assert t.answer == str(word.count(letter))
            else:
                word = t.prompt.split(": ")[1]
                expect = {"reverse": word[::-1], "sort": "".join(sorted(word)), "copy": word}
                assert t.answer == expect[family]


@pytest.mark.parametrize("options", [
    dict(unmasking="topk", tokens_per_step=1, cache="none"),
    dict(unmasking="threshold", threshold=0.9, cache="dual"),
], ids=["vanilla", "dual-0.9"])
def test_demo_model_answers_held_out_tasks(demo_llm, tokenizer, options):
    # `sangam-bench quality` measures 96% exact match on 240 held-out instances; here 24.
    tasks = eval_set(6, families=DEMO_FAMILIES)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t.prompt}],
                                             add_generation_prompt=True, tokenize=False)
               for t in tasks]
    params = SamplingParams(max_tokens=DEMO_MAX_TOKENS, block_length=DEMO_BLOCK_LENGTH,
                            **options)
    outs = demo_llm.generate(prompts, params)
    right = [o.text == t.answer for o, t in zip(outs, tasks)]
    assert sum(right) >= 0.9 * len(tasks), [(t.prompt, o.text) for o, t in zip(outs, tasks)]
    assert all(o.finish_reason == "stop" for o in outs)


@pytest.mark.parametrize("options", [
    dict(unmasking="topk", tokens_per_step=1, cache="none"),
    dict(unmasking="threshold", threshold=0.9, cache="dual"),
], ids=["vanilla", "dual-0.9"])
def test_long_demo_answers_over_many_blocks(options):
    # `sangam-bench quality --model sangam-demo-long` measures the whole sweep; here 12 tasks.
    llm = LLM(model="sangam-demo-long", device="cpu", dtype="float32")
    tasks = eval_set(4, families=LONG_FAMILIES)
    prompts = [llm.loaded.text.encode_chat([{"role": "user", "content": t.prompt}]) for t in tasks]
    params = llm.loaded.default_params()
    assert (params.max_tokens, params.block_length) == (160, 16)
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=dataclasses.replace(params, **options))
    right = [o.text == t.answer for o, t in zip(outs, tasks)]
    assert sum(right) >= 0.9 * len(tasks), [(t.answer, o.text) for o, t in zip(outs, tasks)]
    assert min(len(t.answer) for t in tasks) >= 4 * 16  # every answer spans 4+ blocks


def test_encode_batch_layout(trainer):
    tasks = [sample_task(f, random.Random(1)) for f in ("copy", "count", "add")]
    ids, prompt_lens, valid = trainer.encode_batch(tasks, response_length=16)
    for row, n, ok, task in zip(ids.tolist(), prompt_lens.tolist(), valid.tolist(), tasks):
        assert row[:n] == encode(chat_prompt(task.prompt))
        answer = encode(task.answer)
        assert row[n:n + len(answer) + 1] == answer + [EOT_ID]
        assert set(row[n + len(answer) + 1:n + 16]) == {EOS_ID}
        assert ok == [True] * (n + 16) + [False] * (len(row) - n - 16)  # the serving canvas


def test_padded_rows_see_exactly_their_own_canvas(trainer):
    # Training batches mix prompt lengths; the key mask must make each row's logits those of the
    # row alone, as LLM.generate decodes it.
    cfg = trainer.TrainConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    model = LLaDAModel(trainer.parse_config(trainer.model_config(cfg)))
    tasks = [sample_task(f, random.Random(2)) for f in ("copy", "count", "reverse")]
    ids, _, valid = trainer.encode_batch(tasks, response_length=8)
    with torch.no_grad():
        batched = model.forward_dense(ids, key_mask=valid)
        for i in range(len(tasks)):
            n = int(valid[i].sum())
            alone = model.forward_dense(ids[i:i + 1, :n])[0]
            torch.testing.assert_close(batched[i, :n], alone)


def test_training_is_bit_reproducible(trainer):
    cfg = trainer.TrainConfig(steps=3, batch_size=4, warmup=2, hidden_size=32, num_layers=1,
                              num_heads=2, intermediate_size=64,
                              threads=torch.get_num_threads())
    runs = [trainer.train(cfg, log=lambda s: None)[0].state_dict() for _ in range(2)]
    assert runs[0].keys() == LLaDAModel(trainer.parse_config(
        trainer.model_config(cfg))).state_dict().keys()
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    other = trainer.train(dataclasses.replace(cfg, seed=1), log=lambda s: None)[0].state_dict()
    assert not all(torch.equal(runs[0][k], other[k]) for k in runs[0])


# ----------------------------------------------------------------------------- sangam-demo-gemma


@pytest.fixture(scope="module")
def gemma_trainer():
    spec = importlib.util.spec_from_file_location(
        "train_demo_gemma", ROOT / "scripts" / "train_demo_gemma.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_gemma_demo_loads_in_its_layout(gemma_trainer):
    """The uniform-state demo: DiffusionGemma's config (as transformers writes it), every tensor
    by its name, Gemma's token ids, and the chat template rendering the prompt it was trained
    on (the training script's own encoding)."""
    from transformers import AutoTokenizer, DiffusionGemmaConfig

    from sangam.models.diffusion_gemma import DiffusionGemmaModel

    path = demo_model_path("sangam-demo-gemma")
    raw = json.loads((Path(path) / "config.json").read_text())
    assert DiffusionGemmaConfig(**raw).text_config.num_experts == 4
    cfg = read_config(path)
    assert cfg.gemma is not None and cfg.gemma.canvas_length == DEMO_MAX_TOKENS
    assert isinstance(load_model(path, "cpu", "float32"), DiffusionGemmaModel)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    task = eval_set(1, families=("reverse",))[0]
    ids = tok.apply_chat_template([{"role": "user", "content": task.prompt}],
                                  add_generation_prompt=True, return_dict=True)["input_ids"]
    prompts, _, _ = gemma_trainer.encode_batch([task], DEMO_MAX_TOKENS)
    assert list(ids) == prompts[0].tolist()


def test_gemma_demo_answers_held_out_tasks():
    """At its generation_config.json's denoising options; `sangam-bench quality --model
    sangam-demo-gemma` sweeps them over 240 instances."""
    llm = LLM(model="sangam-demo-gemma", device="cpu", dtype="float32")
    tasks = eval_set(6, families=DEMO_FAMILIES)
    prompts = [llm.loaded.text.encode_chat([{"role": "user", "content": t.prompt}])
               for t in tasks]
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=SamplingParams(max_tokens=DEMO_MAX_TOKENS, seed=0))
    right = [o.text == t.answer for o, t in zip(outs, tasks)]
    assert sum(right) >= GEMMA_DEMO_MIN_RIGHT * len(tasks), \
        [(t.answer, o.text) for o, t in zip(outs, tasks)]
