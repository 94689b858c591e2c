"""Edits of a request's logits before scoring: logit_bias, penalties, min_tokens."""

import numpy as np
import pytest
import torch

from sangam import SamplingParams
from sangam.decoding import score_logits
from sangam.decoding.logit_edits import (
    RequestEdits,
    apply_edits,
    batch_edits,
    pack_edits,
    request_edits,
    response_token_counts,
)
from sangam.decoding.state import DecodeState

MASK, EOS = 99, 1


def _state(response: list[int], prompt=(5, 6, 5), **kw) -> DecodeState:
    """A request whose canvas holds ``response`` (MASK: not committed yet)."""
    params = SamplingParams(max_tokens=len(response),
                            block_length=kw.pop("block_length", len(response)), **kw)
    st = DecodeState(list(prompt), params, MASK, frozenset({EOS}), shift_logits=False)
    st.tokens[st.cursor.prompt_len:] = response
    return st


def _edits(st: DecodeState, positions) -> RequestEdits | None:
    return request_edits(st, np.asarray(positions, dtype=np.int64))


def test_response_counts_stop_at_the_first_stop_id_and_skip_masks():
    st = _state([7, MASK, 8, 7, EOS, 9, 9, MASK], stop_token_ids=[8])
    assert [a.tolist() for a in response_token_counts(st)] == [[7], [1]]  # cut at 8
    st = _state([7, MASK, 8, 7, EOS, 9, 9, MASK])
    assert [a.tolist() for a in response_token_counts(st)] == [[7, 8], [2, 1]]  # cut at EOS
    st = _state([7, MASK, 8, 7, EOS, 9, 9, MASK], stop_at_eos=False)
    assert [a.tolist() for a in response_token_counts(st)] == [[1, 7, 8, 9], [1, 2, 1, 2]]


@pytest.mark.parametrize("extra_stops", [[], [8], [8, 20, 21, 22, 23, 24]])
def test_stop_index_is_the_first_stop_id(extra_stops):
    """Few stop ids (compared one by one) and many (np.isin) give the same answer."""
    rng = np.random.default_rng(len(extra_stops))
    st = _state([MASK] * 8, stop_token_ids=extra_stops)
    stops = {EOS, *extra_stops}
    for _ in range(50):
        response = rng.integers(0, 30, rng.integers(0, 12))
        want = next((i for i, t in enumerate(response.tolist()) if t in stops), len(response))
        assert st.stop_index(response) == want


def test_presence_and_frequency_are_subtracted_and_merge_with_logit_bias():
    st = _state([7, MASK, 8, 7], presence_penalty=0.5, frequency_penalty=0.25,
                logit_bias={7: 1.0, 40: -2.0})
    e = _edits(st, [4, 5])
    assert e.add_ids.tolist() == [7, 8, 40]
    assert e.add_values.tolist() == [1.0 - 0.5 - 2 * 0.25, -0.5 - 0.25, -2.0]
    assert e.ban_ids.size == 0 and e.rep_ids.size == 0
    assert _edits(_state([7, 8]), [3]) is None  # nothing asked: nothing to do
    assert _edits(_state([MASK, MASK], frequency_penalty=1.0), [3, 4]) is None  # nothing yet


def test_repetition_penalty_covers_prompt_and_response_and_keeps_the_sign_rule():
    st = _state([7, MASK, EOS, 9], repetition_penalty=2.0)
    e = _edits(st, [4])
    assert sorted(e.rep_ids.tolist()) == [5, 6, 7] and e.repetition_penalty == 2.0  # 9: past EOS
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 6.0, -6.0, 0.5]], dtype=torch.float64)
    edits = pack_edits([e], [1]).map(torch.from_numpy)
    apply_edits(x, edits)
    assert x.tolist() == [[0.0, 1.0, 2.0, 3.0, 4.0, 3.0, -12.0, 0.25]]


def test_min_tokens_bans_the_stop_ids_at_the_first_positions_only():
    st = _state([MASK] * 8, prompt=(5, 6), stop_token_ids=[4], min_tokens=3)
    e = _edits(st, [2, 3, 4, 5, 7])  # response offsets 0, 1, 2, 3, 5
    assert e.ban_ids.tolist() == [EOS, 4] and e.num_banned == 3
    assert _edits(st, [5, 6]) is None
    assert _edits(_state([MASK] * 4, stop_at_eos=False, min_tokens=3), [3]) is None  # no stop id
    # The engine scores its rows again only while its block holds one of those positions.
    for min_tokens, second_block in ((5, True), (4, False)):
        st = _state([MASK] * 8, block_length=4, min_tokens=min_tokens)
        assert st.cursor.block < st.params.full_scoring_blocks
        st.cursor.block = 1  # response offsets 4..7
        assert (st.cursor.block < st.params.full_scoring_blocks) == second_block


def _request(add=(), ban=(), num_banned=0, rep=(), penalty=1.0) -> RequestEdits:
    ids = np.array([t for t, _ in add], dtype=np.int64)
    return RequestEdits(ids, np.array([v for _, v in add], dtype=np.float64),
                        np.array(ban, dtype=np.int64), num_banned, np.array(rep, dtype=np.int64),
                        penalty)


def test_pack_and_score():
    """Groups of rows; a ban beats any bias; scoring sees the edited logits."""
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]] * 5, dtype=torch.float64)
    banned = _request(add=[(0, 9.0)], ban=[0, 3], num_banned=1, rep=[1], penalty=2.0)
    biased = _request(add=[(3, 2.5)])
    edits = pack_edits([None, banned, biased], [1, 3, 1])
    assert edits.starts.tolist() == [1, 1, 4] and edits.counts.tolist() == [3, 1, 1]
    assert edits.width == 3
    assert edits.add_groups.tolist() == [0, 1, 1, 2] and edits.add_ids.tolist() == [0, 0, 3, 3]
    assert edits.add_values.tolist() == [9.0, -np.inf, -np.inf, 2.5]
    assert edits.rep_groups.tolist() == [0] and edits.rep_ids.tolist() == [1]
    assert edits.rep_values.tolist() == [2.0]
    assert pack_edits([None, None], [3, 1]) is None
    tokens, conf, _ = score_logits(logits, 2, edits=edits.map(torch.from_numpy))
    expect = logits.clone()
    expect[1:4, 1] = 0.5
    expect[1:4, 0] += 9.0
    expect[1, 0] = expect[1, 3] = float("-inf")
    expect[4, 3] += 2.5
    expect[:, 2] = float("-inf")  # the mask token stays excluded, whatever the edits
    assert tokens.tolist() == [3, 1, 0, 0, 3]
    torch.testing.assert_close(conf, torch.softmax(expect, -1).gather(1, tokens[:, None])[:, 0])


@pytest.mark.parametrize("seed", range(5))
def test_apply_equals_editing_each_row_by_hand(seed):
    """The device-side expansion of groups equals editing each request's rows one by one."""
    rng = np.random.default_rng(seed)
    vocab, counts = 50, [int(c) for c in rng.integers(1, 7, size=6)]
    requests = []
    for n in counts:
        if rng.random() < 0.2:
            requests.append(None)
            continue
        add = [(int(t), float(rng.normal())) for t in rng.choice(vocab, rng.integers(0, 6), False)]
        ban = rng.choice(vocab, rng.integers(0, 3), False).tolist()
        requests.append(_request(add, ban, int(rng.integers(0, n + 1)) if ban else 0,
                                 rng.integers(0, vocab, rng.integers(0, 9)).tolist(),
                                 float(rng.uniform(0.5, 3))))
    x = torch.from_numpy(rng.normal(size=(sum(counts), vocab)))
    want = x.clone()
    start = 0
    for e, n in zip(requests, counts, strict=True):
        if e is not None:
            block = want[start:start + n]
            rep = np.unique(e.rep_ids)
            block[:, rep] = torch.where(block[:, rep] > 0, block[:, rep] / e.repetition_penalty,
                                        block[:, rep] * e.repetition_penalty)
            block[:, e.add_ids] += torch.from_numpy(e.add_values)
            block[:e.num_banned, e.ban_ids] = float("-inf")
        start += n
    edits = pack_edits(requests, counts)
    if edits is not None:
        apply_edits(x, edits.map(torch.from_numpy))
    assert torch.equal(x, want)


@pytest.mark.parametrize("seed", range(6))
def test_batch_edits_equal_each_requests_edits(seed):
    """The engine's batch-wide construction equals packing every request's own edits: the
    same logits after applying them, exactly."""
    rng = np.random.default_rng(seed)
    vocab = 40
    states, positions, counts = [], [], []
    for _ in range(int(rng.integers(1, 9))):
        opts = dict(
            presence_penalty=float(rng.choice([0.0, 0.0, 0.5])),
            frequency_penalty=float(rng.choice([0.0, 0.0, 0.3])),
            repetition_penalty=float(rng.choice([1.0, 1.0, 1.7])),
            min_tokens=int(rng.choice([0, 0, 3])), stop_at_eos=bool(rng.random() < 0.7),
            stop_token_ids=rng.choice(vocab, int(rng.integers(0, 3)), False).tolist(),
            logit_bias={int(t): float(rng.normal())
                        for t in rng.choice(vocab, int(rng.integers(0, 4)), False)})
        response = [int(t) if rng.random() < 0.7 else MASK for t in rng.integers(0, vocab, 8)]
        st = _state(response, prompt=rng.integers(0, vocab, 5).tolist(), **opts)
        masked = np.flatnonzero(st.tokens == MASK)
        n = int(rng.integers(0, len(masked) + 1))
        states.append(st)
        positions.append(np.sort(rng.choice(masked, n, False)) if n else masked[:0])
        counts.append(n)
    want = pack_edits([request_edits(st, pos) for st, pos in zip(states, positions)], counts)
    got = batch_edits(states, positions, counts)
    assert (got is None) == (want is None)
    if want is not None:
        x = torch.from_numpy(rng.normal(size=(sum(counts), MASK + 1)))
        y = x.clone()
        apply_edits(x, want.map(torch.from_numpy))
        apply_edits(y, got.map(torch.from_numpy))
        assert torch.equal(x, y)


def test_validation():
    p = SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=1.5)
    assert p.penalizes and p.needs_full_scoring
    assert not SamplingParams(min_tokens=3).needs_full_scoring  # the state decides, per block
    assert SamplingParams(min_tokens=5, block_length=4).full_scoring_blocks == 2
    assert SamplingParams(min_tokens=5, stop_at_eos=False).full_scoring_blocks == 0  # no stop id
    assert SamplingParams(min_tokens=5, stop_at_eos=False, stop_token_ids=[3],
                          block_length=4).full_scoring_blocks == 2
    assert SamplingParams(logprobs=1).full_scoring_blocks == float("inf")
    for name, bad in [("presence_penalty", 2.5), ("frequency_penalty", float("nan")),
                      ("repetition_penalty", 0), ("repetition_penalty", True),
                      ("min_tokens", -1), ("min_tokens", 300), ("min_tokens", 1.0)]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: bad})
