"""``sangam-bench quality``: the sweep's metrics on the short demo model, block agreement, and
``--structured``: the demo tasks with and without their answer format as a constraint."""

import json
import re

import pytest

from sangam.bench.cli import main
from sangam.bench.quality import (
    DEFAULT_THRESHOLDS,
    block_agreement,
    parse_cadences,
    sweep,
    trained_families,
)
from sangam.demo import demo_model_path
from sangam.demo.tasks import ANSWER_FORMATS, FAMILIES, generate


def test_block_agreement_counts_blocks_up_to_where_either_response_ends():
    ref = list(range(20))  # blocks of 8: [0..8), [8..16), [16..20) and its end
    assert block_agreement(ref, ref, 8) == (3, 3)
    assert block_agreement(ref[:19], ref, 8) == (2, 3)  # ends one token early: last block differs
    changed = ref[:9] + [99] + ref[10:]
    assert block_agreement(changed, ref, 8) == (2, 3)
    assert block_agreement(ref + [20] * 5, ref, 8) == (2, 4)  # runs on into a fourth block
    assert block_agreement(list(range(16)), list(range(16)), 8) == (3, 3)  # the end is a block


def test_the_sweep_covers_both_caches_and_rules():
    names = [m.name for m in sweep()]
    assert names[0] == "vanilla" and len(names) == len(set(names))
    for cache in ("prefix", "dual"):
        assert {f"{cache}/threshold={v:g}" for v in DEFAULT_THRESHOLDS} <= set(names)
        assert f"{cache}/factor=1" in names
    assert min(DEFAULT_THRESHOLDS) < 0.5 and 0.9 in DEFAULT_THRESHOLDS  # a bad one, the usual
    modes = {m.name: m.options for m in sweep()}
    never = modes["dual/threshold=0.9/cadence=1000x1"]  # the bad cadence
    assert never == {"unmasking": "threshold", "threshold": 0.9, "cache": "dual",
                     "refresh_interval": 1000, "prompt_refresh_interval": 1}
    assert "dual/threshold=0.9/cadence=1x2" in modes and "dual/threshold=0.9/cadence=4x4" in modes
    assert parse_cadences("2x1, 1x4") == ((2, 1), (1, 4))
    with pytest.raises(ValueError, match="cadences"):
        parse_cadences("2x0")
    adaptive = modes["dual/threshold=0.9/cadence=1000x1/refresh_confidence=0.99"]
    assert adaptive["refresh_interval"] == 1000 and adaptive["refresh_confidence"] == 0.99
    both = [m.name for m in sweep(cadence_thresholds=(0.9, 0.95))]
    assert "dual/threshold=0.95/cadence=1x2" in both and "dual/threshold=0.9/cadence=1x2" in both


def test_quality_reports_agreement_confidence_and_a_plot(tmp_path, capsys):
    out, png = tmp_path / "q.json", tmp_path / "q.png"
    assert main(["quality", "--num-instances", "8", "--thresholds", "0.3,0.9", "--factors", "1",
                 "--modes", "dual/threshold=0.3,dual/threshold=0.9,prefix/factor=1,"
                 "dual/threshold=0.9/cadence=1000x1",
                 "--json", str(out), "--plot", str(png)]) == 0
    table = capsys.readouterr().out
    assert "blocks=vanilla" in table and "dual/threshold=0.9" in table
    report = json.loads(out.read_text())
    # The demo's own task set and canvas: from its training.json and generation_config.json.
    assert report["families"] == list(trained_families(demo_model_path()))
    assert report["families"] == ["reverse", "copy", "sort", "count"]
    assert (report["max_tokens"], report["block_length"]) == (24, 8)
    modes = report["modes"]
    assert list(modes) == ["vanilla", "prefix/factor=1", "dual/threshold=0.3",
                           "dual/threshold=0.9", "dual/threshold=0.9/cadence=1000x1"]
    never = modes["dual/threshold=0.9/cadence=1000x1"]
    assert never["options"]["refresh_interval"] == 1000
    assert modes["vanilla"]["refreshed_blocks"] == 1.0 and 0 < never["refreshed_blocks"] <= 1
    vanilla = modes["vanilla"]
    assert vanilla["block_agreement"] == 1.0 and vanilla["tokens_per_forward"] == 1.0
    assert 8 <= vanilla["forwards_per_request"] <= 24  # a forward per token of the blocks decoded
    for r in modes.values():
        assert 0 <= r["accuracy"] <= 1 and 0 <= r["block_agreement"] <= 1
        assert 0 < r["confidence"] <= 1
    fast, careful = modes["dual/threshold=0.3"], modes["dual/threshold=0.9"]
    # The short demo is confident: both commit whole blocks of 8 (the long demo's test sees the
    # threshold's cost).
    assert fast["tokens_per_forward"] >= careful["tokens_per_forward"] > 1
    assert fast["confidence"] <= careful["confidence"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_family_has_an_answer_format_its_answers_match():
    assert set(ANSWER_FORMATS) == set(FAMILIES)
    for family in FAMILIES:
        for task in generate(family, 50, seed=7, split="train") + generate(family, 50, seed=7):
            assert re.fullmatch(ANSWER_FORMATS[family], task.answer), (family, task.answer)
    assert not re.fullmatch(ANSWER_FORMATS["reverse"], "ab")  # the generators' real bounds
    assert not re.fullmatch(ANSWER_FORMATS["count"], "7")


def test_structured_compares_with_and_without_the_answer_regex(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["quality", "--structured", "--num-instances", "4", "--thresholds", "0.9",
                 "--repeats", "1", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "valid %" in table and "without / with" in table
    report = json.loads(out.read_text())
    assert report["families"] == ["reverse", "copy", "sort", "count"]
    entry = report["settings"]["threshold=0.9"]
    assert report["options"]["threshold=0.9"]["cache"] == "dual"
    without, with_ = entry["without"], entry["with"]
    assert set(with_) == {"all", "reverse", "copy", "sort", "count"}
    assert with_["all"]["valid"] == 1.0  # what the constraint guarantees
    for row in entry["outputs"]:
        assert re.fullmatch(report["answer_formats"][row["family"]], row["with"])
    for side in (without, with_):
        m = side["all"]
        assert m["n"] == 4 and 0 <= m["exact"] <= 1 and m["tokens_per_forward"] > 0
        assert m["forwards_per_request"] >= 1 and m["batch_ms_per_request"] > 0
        assert m["alone_ms"] > 0 and m["identical_outputs"] == 1.0  # batch invariance


def test_structured_on_a_uniform_state_model(tmp_path, capsys):
    """DiffusionGemma's canvases under the answer regex: every output valid, and the
    constraint adds no forwards of its own (the same step rule decides them)."""
    out = tmp_path / "g.json"
    assert main(["quality", "--model", "sangam-demo-gemma", "--structured", "--num-instances",
                 "4", "--entropy-bounds", "0.5", "--denoising-steps", "4", "--repeats", "1",
                 "--json", str(out)]) == 0
    assert "uniform-state decoding" in capsys.readouterr().out
    report = json.loads(out.read_text())
    entry = report["settings"]["entropy_bound=0.5/steps=4"]
    assert entry["with"]["all"]["valid"] == 1.0
    for row in entry["outputs"]:
        assert re.fullmatch(report["answer_formats"][row["family"]], row["with"])
    for side in ("without", "with"):
        m = entry[side]["all"]
        assert 1 <= m["forwards_per_request"] and m["identical_outputs"] == 1.0


def test_quality_writes_each_modes_commit_profile(tmp_path, capsys):
    from sangam.bench.sim.steps import load_mode_profiles

    out, prof = tmp_path / "q.json", tmp_path / "profiles.json"
    assert main(["quality", "--num-instances", "4", "--thresholds", "0.9", "--factors", "1",
                 "--modes", "dual/threshold=0.9,dual/threshold=0.9/cadence=1000x1/"
                 "refresh_confidence=0.999", "--torch-threads", "1", "--json", str(out),
                 "--profiles", str(prof)]) == 0
    capsys.readouterr()
    report = json.loads(out.read_text())["modes"]
    profiles = load_mode_profiles(str(prof))
    assert list(profiles) == list(report)  # one entry per mode, vanilla included
    for name, r in report.items():
        p = profiles[name]
        # What the engine was stepped for equals what its final outputs count.
        assert p.tokens_per_forward == pytest.approx(r["tokens_per_forward"])
        assert p.steps.mean_tokens_per_forward() == pytest.approx(r["tokens_per_forward"])
        assert sum(p.steps.steps_per_block.values()) * p.steps.block_length == round(
            r["tokens_per_forward"] * r["forwards_per_request"] * 4)
        assert p.accuracy == r["accuracy"] and p.block_agreement == r["block_agreement"]
        assert p.steps.block_length == 8
    vanilla = profiles["vanilla"]
    assert vanilla.steps.steps_per_block == {8: sum(vanilla.steps.steps_per_block.values())}
    adaptive = profiles["dual/threshold=0.9/cadence=1000x1/refresh_confidence=0.999"]
    assert adaptive.refresh_interval == 1000 and adaptive.refresh_confidence == 0.999
    entry = json.loads(prof.read_text())["modes"]["dual/threshold=0.9"]
    assert entry["refreshed_per_block"][0][0] == entry["refreshed_per_block"][0][1] == 4


def test_the_uniform_sweep_reports_exact_match_and_forwards_per_canvas(tmp_path, capsys):
    out = tmp_path / "g.json"
    assert main(["quality", "--model", "sangam-demo-gemma", "--num-instances", "4",
                 "--entropy-bounds", "0.1", "--denoising-steps", "1,4",
                 "--json", str(out)]) == 0
    assert "exact match (forwards per canvas)" in capsys.readouterr().out
    modes = json.loads(out.read_text())["modes"]
    assert list(modes) == ["entropy_bound=0.1/steps=1", "entropy_bound=0.1/steps=4"]
    one, four = modes.values()
    assert one["forwards_per_canvas"] == 1.0 and one["options"]["max_denoising_steps"] == 1
    assert 1.0 <= four["forwards_per_canvas"] <= 4.0
    assert sum(map(int, four["steps_per_block"])) > 0
    for r in modes.values():
        assert 0 <= r["accuracy"] <= 1
        per_forward = r["block_length"] / r["forwards_per_canvas"]
        assert r["tokens_per_forward"] == pytest.approx(per_forward)


@pytest.mark.parametrize("model, flag", [("sangam-demo-gemma", ["--thresholds", "0.9"]),
                                          ("sangam-demo-gemma", ["--cache", "dual"]),
                                          ("sangam-demo-gemma", ["--factors", "1"]),
                                          (None, ["--entropy-bounds", "0.5"]),
                                          (None, ["--confidence-threshold", "0"])])
def test_the_other_familys_flags_are_refused(model, flag):
    with pytest.raises(SystemExit, match=flag[0]):
        main(["quality", "--num-instances", "1", *(["--model", model] if model else []), *flag])
