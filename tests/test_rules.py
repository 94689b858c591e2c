"""Unmasking rules on hand-made confidence vectors, and the Gumbel noise hash."""

import pytest
import torch

from sangam import SamplingParams
from sangam.decoding import gumbel_noise, noise_key, row_key, score_logits, select_commits
from sangam.decoding.confidence import sampling_support
from sangam.decoding.noise import mix32, mix32_tensor


def test_threshold_commits_all_above_and_at_least_one():
    assert select_commits([0.95, 0.2, 0.91, 0.9], "threshold", threshold=0.9) == [0, 2, 3]
    assert select_commits([0.3, 0.5, 0.1], "threshold", threshold=0.9) == [1]  # all below
    assert select_commits([0.42], "threshold", threshold=0.9) == [0]  # one candidate left
    assert select_commits([], "threshold") == []


def test_ties_go_to_the_earlier_position():
    assert select_commits([0.5, 0.7, 0.7, 0.1], "threshold", threshold=0.9) == [1]
    assert select_commits([0.7, 0.7, 0.7], "topk", tokens_per_step=2) == [0, 1]
    assert select_commits([0.2, 0.2], "factor", factor=1.0) == [0]


def test_topk():
    assert select_commits([0.1, 0.9, 0.5, 0.7], "topk", tokens_per_step=2) == [1, 3]
    assert select_commits([0.1, 0.9], "topk", tokens_per_step=5) == [0, 1]


def test_factor_rule_longest_prefix():
    # sorted: 0.99 (k=1, always), 0.8 (k=2 needs >= 1 - 1/3 = 0.667), 0.76 (k=3 needs >= 0.75),
    # 0.79 is k=3 actually: order 0.99, 0.8, 0.79, 0.76; k=4 needs >= 0.8 -> stop before 0.76.
    conf = [0.76, 0.99, 0.8, 0.79]
    assert select_commits(conf, "factor", factor=1.0) == [1, 2, 3]
    assert select_commits(conf, "factor", factor=0.1) == [1]  # k=2 needs >= 0.967
    # A later candidate that would pass does not rescue a broken prefix.
    assert select_commits([0.99, 0.5, 0.9], "factor", factor=1.0) == [0, 2]
    assert select_commits([0.99, 0.6, 0.5], "factor", factor=1.0) == [0]


def test_mix32_known_values_and_tensor_agreement():
    assert mix32(0) == 0
    xs = [1, 2, 12345, 0xFFFFFFFF, 0xDEADBEEF]
    got = mix32_tensor(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [mix32(x) for x in xs]
    assert len(set(got)) == len(xs)


def test_gumbel_noise_is_keyed_and_plausible():
    k = noise_key(7, block=1, step=2)
    assert k == noise_key(7, 1, 2) and k != noise_key(7, 1, 3) and k != noise_key(8, 1, 2)
    keys = torch.tensor([row_key(k, 0), row_key(k, 1)])
    g = gumbel_noise(keys, 50_000, torch.float64)
    assert torch.equal(g, gumbel_noise(keys, 50_000, torch.float64))
    assert not torch.equal(g[0], g[1])
    assert abs(g.mean().item() - 0.5772) < 0.02  # Euler–Mascheroni
    assert abs(g.var().item() - torch.pi**2 / 6) < 0.05


def test_score_logits_excludes_mask_and_reports_probability():
    logits = torch.tensor([[0.0, 1.0, 5.0], [3.0, 3.0, 0.0]], dtype=torch.float64)
    tokens, conf, _ = score_logits(logits, mask_token_id=2)
    assert tokens.tolist() == [1, 0]  # mask excluded; tie -> first index
    torch.testing.assert_close(conf, torch.tensor([1 / (1 + torch.e**-1), 0.5],
                                                  dtype=torch.float64))


def test_score_logits_temperature_samples_and_keeps_untempered_confidence():
    logits = torch.zeros(2000, 4, dtype=torch.float64)
    logits[:, 1] = 1.0
    keys = torch.tensor([row_key(noise_key(3, 0, 0), i) for i in range(2000)])
    tokens, conf, _ = score_logits(logits, 3, torch.full((2000,), 1.0), keys)
    freq = torch.bincount(tokens, minlength=4).double() / 2000
    p = torch.softmax(torch.tensor([0.0, 1.0, 0.0]), 0).double()
    assert freq[3] == 0
    assert torch.allclose(freq[:3], p, atol=0.04)
    probs = torch.softmax(logits[:, :3], -1)
    torch.testing.assert_close(conf, probs.gather(1, tokens[:, None]).squeeze(1))


def test_temperature_limits():
    assert SamplingParams(temperature=1e-300).temperature == 0.0  # greedy, not id 0 forever
    for bad in (float("inf"), float("nan"), 1e30, -1.0):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)


def _support_by_hand(row: list[float], top_p: float, top_k: int, min_p: float) -> set[int]:
    """vLLM's rule on one row of probabilities, the slow way: min_p and top_k filter, then
    top_p over what they kept, renormalized."""
    ranked = sorted(range(len(row)), key=lambda i: (-row[i], i))
    if top_k > 0:
        ranked = ranked[:top_k]
    ranked = [i for i in ranked if row[i] >= min_p * max(row)]
    mass = sum(row[i] for i in ranked)
    ranked = [i for i in ranked if row[i] > 0]  # the mask token: never sampled
    kept, total = [], 0.0
    for i in ranked:
        if kept and top_p < 1 and total >= top_p * mass:
            break
        kept.append(i)
        total += row[i]
    return set(kept)


@pytest.mark.parametrize("top_p,top_k,min_p", [
    (1.0, 0, 0.0), (0.5, 0, 0.0), (0.9, 0, 0.0), (1.0, 3, 0.0), (0.8, 2, 0.0), (1e-9, 0, 0.0),
    (1.0, 0, 0.3), (0.7, 4, 0.1), (1.0, 0, 1.0)])
def test_top_p_top_k_min_p_sample_only_the_support(top_p, top_k, min_p):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(400, 9, generator=gen, dtype=torch.float64) * 2
    logits[:50, 4] = logits[:50, 5]  # ties at the boundary: the lower id ranks first
    keys = torch.tensor([row_key(noise_key(7, 0, 0), i) for i in range(400)])
    temp = torch.full((400,), 1.5)
    tokens, conf, _ = score_logits(logits, 8, temp, keys, torch.full((400,), top_p),
                                   torch.full((400,), top_k), torch.full((400,), min_p))
    unrestricted, _, _ = score_logits(logits, 8, temp, keys)
    x = logits.clone()
    x[:, 8] = float("-inf")
    tempered = torch.softmax(x / 1.5, -1)
    keep = sampling_support(x / 1.5, torch.full((400,), top_p), torch.full((400,), top_k),
                            torch.full((400,), min_p))
    for r in range(400):
        support = _support_by_hand(tempered[r].tolist(), top_p, top_k, min_p)
        possible = set((keep[r] & (tempered[r] > 0)).nonzero().flatten().tolist())
        assert possible == support, r
        assert tokens[r].item() in support, r
        if unrestricted[r].item() in support:  # the same Gumbel draw, argmax over fewer tokens
            assert tokens[r] == unrestricted[r], r
    assert torch.equal(tokens, unrestricted) == ((top_p, top_k, min_p) == (1.0, 0, 0.0))
    # Confidence stays the untempered probability of the sampled token (DESIGN §2).
    torch.testing.assert_close(conf, torch.softmax(x, -1).gather(1, tokens[:, None])[:, 0])
    if top_p == 1e-9 or top_k == 1:
        assert torch.equal(tokens, x.argmax(-1))
    if min_p == 1.0:  # the top token, or any of those tied with it (rows < 50 may have two)
        assert torch.equal(tokens[50:], x[50:].argmax(-1))


def test_top_p_counts_the_mass_left_by_top_k_and_min_p():
    """vLLM renormalizes before top_p: of probabilities (.5, .3, .1, .1) top_k=2 leaves
    (.625, .375), whose first token alone reaches top_p=.6."""
    scaled = torch.tensor([[0.5, 0.3, 0.1, 0.1]]).log()

    def support(top_p: float, top_k: int, min_p: float) -> list[int]:
        keep = sampling_support(scaled, torch.tensor([top_p]), torch.tensor([top_k]),
                                torch.tensor([min_p]))
        return keep[0].nonzero().flatten().tolist()

    assert support(0.6, 0, 0.0) == [0, 1]
    assert support(0.6, 2, 0.0) == [0]
    assert support(0.6, 0, 0.5) == [0]  # min_p .5 keeps p >= .25, then .5/.8 >= .6
    assert support(1.0, 0, 0.25) == [0, 1]
    assert support(1.0, 0, 0.0) == [0, 1, 2, 3]


def test_top_p_top_k_validation():
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "all tokens"
    assert not SamplingParams(top_p=0.5).restricts_sampling  # greedy: the top token anyway
    assert SamplingParams(top_p=0.5, temperature=1.0).restricts_sampling
    assert SamplingParams(min_p=0.1, temperature=1.0).restricts_sampling
    for bad in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="min_p"):
            SamplingParams(min_p=bad)
    for bad in (0.0, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(top_p=bad)
    for bad in (-2, 1.5, True):
        with pytest.raises(ValueError, match="top_k"):
            SamplingParams(top_k=bad)


def test_logit_bias_validation():
    p = SamplingParams(logit_bias={9: -1, 2: 100})
    assert p.logit_bias == ((2, 100.0), (9, -1.0)) and p.needs_full_scoring
    assert hash(p) == hash(SamplingParams(logit_bias=[(2, 100.0), (9, -1)]))
    assert not SamplingParams().needs_full_scoring
    for bad in ({1: 101}, {-1: 1.0}, {"7": 1.0}, {1: float("nan")}, [(1, 1.0), (1, 2.0)], 3):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, (
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])])
def test_scoring_with_known_sampled_rows_needs_no_sync(device):
    """Given the sampled rows (``hot``, known on the host), scoring with sampling filters
    equals the search on the device, and on a GPU it never waits for the device."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 50, generator=gen) * 3).to(device)
    temp = torch.tensor([0.0, 0.7] * 32, dtype=torch.float64)
    keys = torch.tensor([row_key(noise_key(1, 0, 0), i) for i in range(64)])
    filters = (torch.full((64,), 0.8), torch.full((64,), 5), torch.full((64,), 0.05))
    args = [t.to(device) for t in (temp, keys, *filters)]
    searched = score_logits(logits, 49, *args, top_n=3)
    hot = torch.nonzero(temp > 0).flatten().to(device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        given = score_logits(logits, 49, *args, top_n=3, hot=hot)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    for a, b in zip((searched.tokens, searched.conf, *searched.top),
                    (given.tokens, given.conf, *given.top)):
        assert torch.equal(a, b)
    greedy = logits.clone()
    greedy[:, 49] = float("-inf")  # the mask token is never chosen
    greedy = greedy.argmax(-1)
    assert torch.equal(given.tokens[0::2], greedy[0::2])  # greedy rows stay greedy
    assert not torch.equal(given.tokens[1::2], greedy[1::2])  # sampled rows sample
    # No sampled row: nothing is drawn.
    none = score_logits(logits, 49, *args, hot=torch.empty(0, dtype=torch.int64, device=device))
    assert torch.equal(none.tokens, greedy)


def test_each_request_composes_its_decoding_family():
    """A request's step rules follow its options: an unmasking rule or, with structured
    output, the grammar frontier (which reads its rows' logits, and which the C++ host path
    leaves to Python: its record says so); token editing beside either. The composition travels
    with the state between processes as what it is made of."""
    import pickle

    import numpy as np

    from sangam.decoding.family import EDITING, FRONTIER, UNMASKING
    from sangam.decoding.state import DECODE_FIELDS, DecodeState

    def state(**options) -> DecodeState:
        grammar = options.pop("grammar", None)
        return DecodeState([3, 4], SamplingParams(max_tokens=8, block_length=4, **options),
                           mask_token_id=99, stop_ids=frozenset({1}), shift_logits=False,
                           block_causal=True, grammar=grammar)

    host = DECODE_FIELDS.index("host_commits")
    plain, edits = state(), state(edit_threshold=0.5, max_post_steps=2)
    assert (plain.family.selector, plain.family.editing) == (UNMASKING, None)
    assert (edits.family.selector, edits.family.editing) == (UNMASKING, EDITING)
    assert plain.record[host] == edits.record[host] == 1 and not plain.family.reads_logits
    structured = state(grammar=object())  # the family reads only that there is a matcher
    assert structured.family.selector is FRONTIER and structured.family.reads_logits
    assert structured.record[host] == 0
    moved = pickle.loads(pickle.dumps(edits.family))
    assert (moved.selector, moved.editing) == (UNMASKING, EDITING)
    # Editing adds the block's filled response positions to the plan, after the masked ones
    # (block 0 is [0, 4): the prompt's two tokens, then the response's first two positions).
    edits.tokens[2] = 7
    plan = edits.plan()
    assert plan.positions.tolist() == [3, 2] and plan.num_editable == 1
    assert np.array_equal(plan.rows, plan.positions - plan.span_start)
