"""Decoding: beam search properties (greedy, exhaustive optimum, early stopping, length penalty), the
incremental path against full re-decoding, batching and order, the compiled and graphed steps, continuous batching
(the command end to end: test_decode_cli.py)."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_steps_match_forward
from testkit.decoding import translate
from testkit.oracles import translate_uncached

from mtpipe import platform
from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from mtpipe.config import DecodeConfig, ModelConfig
from mtpipe.engine.translate import batches_by_tokens, translate_batches
from mtpipe.errors import MtpipeError
from mtpipe.model.transformer import Transformer
from mtpipe.engine.search import DecodeRules, LengthPenalty, beam_search
from mtpipe.engine.step_package import PackagedStep

# --------------------------------------------------------------------------------------------------------------------
# Helpers: a hand-made step function, a random peaked model, an independent greedy decoder
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class PrefixRows:
    """State of a hand-made step function: the prefix of every row (after BOS)."""

    prefixes: list[tuple[int, ...]]
    calls: list[int]  # rows per step call, shared by every state of one search

    def select(self, index: torch.Tensor, beams: int = 1) -> "PrefixRows":
        return PrefixRows([self.prefixes[i] for i in index.tolist()], self.calls)


def table_step(table):
    """``step`` over a function prefix -> {token: probability}; unlisted tokens get probability 0."""

    def step(tokens: torch.Tensor, state: PrefixRows):
        state.calls.append(len(tokens))
        prefixes = [p + (t,) if t != BOS_ID else p for p, t in zip(state.prefixes, tokens.tolist())]
        logp = torch.full((len(prefixes), 8), float("-inf"))
        for row, p in enumerate(prefixes):
            for tok, prob in table(p).items():
                logp[row, tok] = math.log(prob)
        return logp, PrefixRows(prefixes, state.calls)

    return step


def max_output_len(src_len: int, cfg: DecodeConfig, max_positions: int) -> int:
    return DecodeRules.from_config(cfg).max_output_len(src_len, max_positions)


def start(n: int) -> PrefixRows:
    return PrefixRows([() for _ in range(n)], [])


def random_table(seed: int, real=(4, 5, 6)):
    """A random but deterministic next-token distribution over ``real`` tokens + EOS for every prefix."""

    def table(prefix):
        g = torch.Generator().manual_seed(hash((seed, prefix)) % (2**31))
        probs = torch.softmax(torch.randn(len(real) + 1, generator=g) * 2.0, 0).tolist()
        return dict(zip((*real, EOS_ID), probs))

    return table


def exhaustive(table, max_len: int, penalty: LengthPenalty, real=(4, 5, 6)) -> list[tuple[float, tuple]]:
    """Every output up to max_len tokens (EOS forced after max_len), scored, best first."""
    out = []
    for n in range(max_len + 1):
        for seq in itertools.product(real, repeat=n):
            lp, prefix = 0.0, ()
            for tok in (*seq, EOS_ID):
                probs = table(prefix)
                lp += math.log(probs[tok]) if tok in probs else float("-inf")
                prefix += (tok,)
            out.append((lp / penalty(n + 1), seq))
    return sorted(out, key=lambda x: -x[0])


@pytest.fixture(scope="module")
def model() -> Transformer:
    """A random tiny model with peaked output distributions (scaled embeddings), so argmax has no near ties."""
    torch.manual_seed(0)
    m = Transformer(ModelConfig(preset="tiny", dropout=0.0, max_positions=128), 40).eval()
    with torch.no_grad():
        m.embed.weight.mul_(6.0)
    return m


def sources(n: int, seed: int, lo: int = 1, hi: int = 14, vocab: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(4, vocab, (k,), generator=g).tolist() for k in lengths]


def greedy(model: Transformer, src: list[int], max_len: int, penalty: LengthPenalty) -> tuple[list[int], float]:
    """Reference greedy search, independent of decode.py: the full forward pass over the whole prefix each step,
    argmax over every token but PAD/BOS, EOS forced after max_len tokens."""
    s = torch.tensor([src + [EOS_ID]])
    out: list[int] = []
    total = 0.0
    with torch.no_grad():
        while True:
            logits = model(s, torch.tensor([[BOS_ID] + out]))[0, -1]
            logp = F.log_softmax(logits.float(), dim=-1)
            logp[[PAD_ID, BOS_ID]] = float("-inf")
            tok = EOS_ID if len(out) == max_len else int(logp.argmax())
            total += float(logp[tok])
            if tok == EOS_ID:
                return out, total / penalty(len(out) + 1)
            out.append(tok)


def decode_prepared(prepared, srcs: list[list[int]], cfg: DecodeConfig, device: str = "cpu") -> list:
    """:func:`translate` on a model already prepared (as :class:`mtpipe.engine.translate.MtpipeEngine` decodes):
    ``cfg``'s rules, batches and precision."""
    from mtpipe.engine.translate import search_prepared

    return search_prepared(prepared, srcs, DecodeRules.from_config(cfg), max_tokens=cfg.max_tokens,
                           precision=cfg.precision, device=torch.device(device))


def update_in_place(source: Transformer, model: Transformer, srcs: list[list[int]], cfg: DecodeConfig,
                    before: list) -> list:
    """New weights (a re-initialised copy of ``model``) loaded into ``source`` in place, as training changes the
    weights under a prepared snapshot; returns the new weights' eager translations of ``srcs`` (which differ from
    ``before``, the old weights')."""
    fresh = copy.deepcopy(model)
    torch.manual_seed(123)
    fresh.reset_parameters()
    expected = translate(fresh, srcs, cfg)
    assert [h[0].tokens for h in expected] != [h[0].tokens for h in before]  # the update changes the translations
    source.load_state_dict(fresh.state_dict())
    return expected


def graphed(model: Transformer, capture: bool = False):
    """``model`` prepared to decode in float32 on CPU with decode.cuda_graphs's step: on a CPU without recording
    graphs (``capture=False``), the same padded computation on the same buffers."""
    from mtpipe.engine.cuda_graphs import GraphedStep
    from mtpipe.engine.variants import prepare

    prepared = prepare(model, "fp32", torch.device("cpu"))
    prepared.graphs = GraphedStep(prepared.model, prepared.project, capture=capture)
    return prepared


# --------------------------------------------------------------------------------------------------------------------
# Length penalty and search rules
# --------------------------------------------------------------------------------------------------------------------


def test_length_penalty_known_values():
    gnmt = LengthPenalty("gnmt", 0.6)
    assert gnmt(1) == pytest.approx(1.0)  # ((5 + 1) / 6) ^ a
    assert gnmt(7) == pytest.approx(2.0**0.6)  # ((5 + 7) / 6) = 2
    assert gnmt(25) == pytest.approx(5.0**0.6)
    assert LengthPenalty("gnmt", 1.0)(13) == pytest.approx(3.0)
    fairseq = LengthPenalty("fairseq", 0.5)
    assert fairseq(4) == pytest.approx(2.0)  # |Y| ^ a
    assert fairseq(9) == pytest.approx(3.0)
    assert LengthPenalty("fairseq", 0.0)(50) == 1.0 and LengthPenalty("gnmt", 0.0)(50) == 1.0
    with pytest.raises(MtpipeError, match="length_penalty"):
        LengthPenalty("average", 1.0)


def test_max_output_len_is_a_times_source_plus_b_capped_by_positions():
    cfg = DecodeConfig(max_len_a=1.5, max_len_b=10)
    assert max_output_len(4, cfg, 1024) == 16
    assert max_output_len(4, DecodeConfig(), 1024) == 54  # paper: input length + 50
    assert max_output_len(100, cfg, 64) == 63  # BOS + 63 tokens fill 64 positions


def test_beam_finds_a_better_output_than_greedy():
    # Greedy takes 'a' (0.6), after which every continuation is unlikely; 'b' (0.4) is followed by EOS (0.99).
    def table(p):
        if p == ():
            return {4: 0.6, 5: 0.4}
        if p[0] == 5:
            return {EOS_ID: 0.99, 6: 0.01}
        return {4: 0.3, 5: 0.25, 6: 0.25, EOS_ID: 0.2}

    lp = LengthPenalty("gnmt", 0.0)
    greedy_hyp = beam_search(table_step(table), start(1), [5], 1, lp)[0][0]
    beam_hyp = beam_search(table_step(table), start(1), [5], 4, lp)[0][0]
    assert greedy_hyp.tokens[0] == 4
    assert beam_hyp.tokens == [5]
    assert beam_hyp.score == pytest.approx(math.log(0.4 * 0.99))
    assert beam_hyp.score > greedy_hyp.score + 0.5


@pytest.mark.parametrize("kind,alpha", [("gnmt", 0.6), ("gnmt", 2.0), ("fairseq", 1.0), ("gnmt", 0.0)])
def test_wide_beam_with_early_stopping_finds_the_exhaustive_optimum(kind, alpha):
    # A beam wider than every possible prefix explores everything, so the result can only differ from exhaustive
    # search if the early-stopping rule stops too soon; the n-best list must be the exhaustive top n.
    # (2 real tokens, at most 6 before EOS: at most 2^5 live prefixes, so 2^5 * 3 extensions per step < 128.)
    lp = LengthPenalty(kind, alpha)
    steps = []
    for seed in range(8):
        table = random_table(seed, real=(4, 5))
        truth = exhaustive(table, 6, lp, real=(4, 5))
        state = start(1)
        hyps = beam_search(table_step(table), state, [6], 128, lp, nbest=3)[0]
        assert [tuple(h.tokens) for h in hyps] == [seq for _, seq in truth[:3]]
        assert [h.score for h in hyps] == pytest.approx([s for s, _ in truth[:3]])
        steps.append(len(state.calls))
    assert min(steps) < 7  # early stopping did stop some searches before the length limit, and lost nothing


def long_wins(p):
    """EOS first is likely (0.6), but 'a' (0.4) continues almost surely to 'a a a a' and then EOS: under a strong
    length penalty the long output wins."""
    if p == ():
        return {EOS_ID: 0.6, 4: 0.4}
    return {4: 0.999, EOS_ID: 0.001} if len(p) < 4 else {EOS_ID: 1.0}


def test_early_stopping_keeps_a_live_hypothesis_that_can_still_win_by_length():
    # EOS first is likely (0.6), but under a strong length penalty the almost-certain continuation 'a a a a' wins:
    # (log 0.4 + 3 log 0.999) / lp(5) > log 0.6 / lp(1). After step 1 the live 'a' has log-prob log 0.4, whose bound
    # with the *next* length only, log 0.4 / lp(2), is below log 0.6: a search bounding by the next length (or
    # stopping once a hypothesis finished) returns the empty output.
    lp = LengthPenalty("gnmt", 2.0)
    assert math.log(0.4) / lp(2) < math.log(0.6) / lp(1)
    hyp = beam_search(table_step(long_wins), start(1), [10], 2, lp)[0][0]
    assert hyp.tokens == [4, 4, 4, 4]
    assert hyp.score == pytest.approx((math.log(0.4) + 3 * math.log(0.999)) / lp(5))
    assert beam_search(table_step(long_wins), start(1), [10], 2, LengthPenalty("gnmt", 0.0))[0][0].tokens == []


def test_stop_finished_stops_once_enough_hypotheses_finished():
    # decode.stop=finished (fairseq's and CTranslate2's rule) on long_wins: step 1 finishes the empty output,
    # step 2 finishes 'a', and with beam 2 that is enough -- the better 'a a a a' that the exact bound waits for is
    # never reached. Waiting for 5 finished hypotheses (patience 2.5) the search goes on and finds it.
    lp = LengthPenalty("gnmt", 2.0)
    state = start(1)
    hyps = beam_search(table_step(long_wins), state, [10], 2, lp, nbest=2, stop_after=2)[0]
    assert len(state.calls) == 2
    assert [h.tokens for h in hyps] == [[], [4]]
    state = start(1)
    hyp = beam_search(table_step(long_wins), state, [10], 2, lp, stop_after=5)[0][0]
    assert hyp.tokens == [4, 4, 4, 4] and len(state.calls) == 5
    with pytest.raises(MtpipeError, match="stop_after 1 is below nbest 2"):
        beam_search(table_step(long_wins), start(1), [10], 2, lp, nbest=2, stop_after=1)


def fairseq_search(table, max_len: int, beam: int, penalty: LengthPenalty, stop_after: int, nbest: int,
                   min_len: int = 0):
    """fairseq's beam search written plainly for one sentence: the 2 x beam best extensions of the live hypotheses;
    those among the top `beam` that end in EOS finish (in rank order, until `stop_after` have: fairseq 0.12's
    finalize_hypos keeps no more than that), the best `beam` that do not are the next live beam; stop once
    `stop_after` have finished (or nothing is live). EOS only after max_len tokens, and never before min_len (fairseq's
    --min-len). Returns (n-best, steps)."""
    live, finished, steps = [((), 0.0)], [], 0
    while True:
        steps += 1
        cands = []
        for prefix, score in live:
            for tok, prob in table(prefix).items():
                if (len(prefix) < max_len or tok == EOS_ID) and (tok != EOS_ID or len(prefix) >= min_len
                                                                  or len(prefix) == max_len):
                    cands.append((score + math.log(prob), prefix, tok))
        cands = sorted(cands, key=lambda c: -c[0])[: 2 * beam]
        nxt = []
        for rank, (score, prefix, tok) in enumerate(cands):
            if tok == EOS_ID:
                if rank < beam and len(finished) < stop_after:  # fairseq keeps the first stop_after, by rank
                    finished.append((score / penalty(len(prefix) + 1), prefix))
            elif len(nxt) < beam:
                nxt.append((prefix + (tok,), score))
        if len(finished) >= stop_after or not nxt:
            return sorted(finished, key=lambda f: -f[0])[:nbest], steps
        live = nxt


def test_stop_finished_keeps_the_first_to_finish_as_fairseq_does():
    # Step 1 finishes the empty output (EOS ranks 3rd of 6, inside beam 3); at step 2 all three live hypotheses end
    # in EOS, one more than stop_after 3 allows. fairseq keeps the first two by rank, (4) and (5); the third, (6),
    # would have outscored the empty output under the length penalty, but it is dropped, not pooled.
    def table(p):
        if p == ():
            return {4: 0.45, 5: 0.44, EOS_ID: 0.06, 6: 0.05}
        return {EOS_ID: 1.0} if p == (6,) else {EOS_ID: 0.99, 4: 0.01}

    lp = LengthPenalty("gnmt", 2.0)
    assert math.log(0.05) / lp(2) > math.log(0.06) / lp(1)  # (6) would have beaten the empty output
    want, _ = fairseq_search(table, 10, 3, lp, 3, 3)
    got = beam_search(table_step(table), start(1), [10], 3, lp, nbest=3, stop_after=3)[0]
    assert [tuple(h.tokens) for h in got] == [p for _, p in want]
    assert sorted(tuple(h.tokens) for h in got) == [(), (4,), (5,)]


@pytest.mark.parametrize("beam", [1, 2, 3])
def test_stop_finished_is_fairseqs_search(beam):
    # decode.stop=finished against the plain re-implementation above, on random next-token tables (no ties): the
    # same n-best, scores and number of steps. At beam 1 both rules are greedy search.
    lp = LengthPenalty("gnmt", 1.0)
    for seed in range(12):
        table = random_table(seed)
        for patience in (1, 2):
            stop_after = max(2, beam * patience) if beam > 1 else 1
            nbest = min(2, beam)
            want, want_steps = fairseq_search(table, 7, beam, lp, stop_after, nbest)
            state = start(1)
            got = beam_search(table_step(table), state, [7], beam, lp, nbest=nbest, stop_after=stop_after)[0]
            assert [tuple(h.tokens) for h in got] == [p for _, p in want]
            assert [h.score for h in got] == pytest.approx([sc for sc, _ in want])
            assert len(state.calls) == want_steps
        if beam == 1:
            exact_state = start(1)
            exact = beam_search(table_step(table), exact_state, [7], 1, lp)[0]
            assert [h.tokens for h in exact] == [h.tokens for h in got] and exact_state.calls == state.calls


@pytest.mark.parametrize("stop", ["bound", "finished"])
def test_min_len_1_never_ends_at_the_first_step_as_fairseq(stop):
    # decode.min_len 1 (fairseq's --min-len and CTranslate2's min_decoding_length default): on long_wins the empty
    # output (EOS first, 0.6) cannot finish, so stop=finished fills its places with longer hypotheses; against the
    # plain re-implementation of fairseq's search on random tables too. A length limit of 0 still forces EOS.
    lp = LengthPenalty("gnmt", 0.0)
    stop_after = 2 if stop == "finished" else None
    hyps = beam_search(table_step(long_wins), start(1), [10], 2, lp, nbest=2, stop_after=stop_after, min_len=1)[0]
    assert all(h.tokens for h in hyps)
    assert beam_search(table_step(long_wins), start(1), [10], 2, lp, stop_after=stop_after)[0][0].tokens == []
    assert beam_search(table_step(long_wins), start(1), [0], 2, lp, stop_after=stop_after, min_len=1)[0][0].tokens == []
    if stop == "finished":
        for seed in range(12):
            table = random_table(seed)
            want, want_steps = fairseq_search(table, 7, 3, lp, 3, 2, min_len=1)
            state = start(1)
            got = beam_search(table_step(table), state, [7], 3, lp, nbest=2, stop_after=3, min_len=1)[0]
            assert [tuple(h.tokens) for h in got] == [p for _, p in want]
            assert len(state.calls) == want_steps


def test_early_stopping_stops_before_the_length_limit():
    # EOS is almost certain after one token: the long hypotheses' bound falls below the finished score quickly.
    def table(p):
        return {4: 0.5, 5: 0.5} if p == () else {EOS_ID: 0.98, 4: 0.01, 5: 0.01}

    state = start(1)
    hyp = beam_search(table_step(table), state, [200], 4, LengthPenalty("gnmt", 0.6))[0][0]
    assert len(hyp.tokens) == 1
    assert len(state.calls) < 10  # far fewer steps than the 200-token limit


def test_length_limit_forces_eos_and_nbest_is_sorted():
    def table(p):  # EOS is never likely: every hypothesis runs to the limit
        return {4: 0.7, 5: 0.29, EOS_ID: 0.01}

    hyps = beam_search(table_step(table), start(2), [3, 0], 4, LengthPenalty("gnmt", 0.6), nbest=4)
    assert hyps[0][0].tokens == [4, 4, 4]
    assert all(len(h.tokens) <= 3 for h in hyps[0])
    assert [h.score for h in hyps[0]] == sorted((h.score for h in hyps[0]), reverse=True)
    assert len(hyps[1]) == 1 and hyps[1][0].tokens == []  # limit 0: EOS at once


def test_pad_and_bos_are_never_generated():
    def table(p):
        return {PAD_ID: 0.5, BOS_ID: 0.3, 4: 0.1, EOS_ID: 0.1} if len(p) < 2 else {EOS_ID: 1.0}

    for beam in (1, 3):
        hyp = beam_search(table_step(table), start(1), [10], beam, LengthPenalty("gnmt", 0.6))[0][0]
        assert PAD_ID not in hyp.tokens and BOS_ID not in hyp.tokens


# --------------------------------------------------------------------------------------------------------------------
# The real model
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_beam_1_equals_greedy(model, alpha):
    cfg = DecodeConfig(beam=1, alpha=alpha, max_len_b=12, max_tokens=40)
    srcs = sources(12, seed=3)
    lp = LengthPenalty("gnmt", alpha)
    got = translate(model, srcs, cfg)
    for src, hyps in zip(srcs, got):
        tokens, score = greedy(model, src, max_output_len(len(src), cfg, 128), lp)
        assert hyps[0].tokens == tokens
        assert hyps[0].score == pytest.approx(score, abs=1e-4)
    assert len({len(h[0].tokens) for h in got}) > 1  # outputs of several lengths, some before the limit


def test_incremental_decoding_matches_full_re_decoding(model):
    # Step level: the cached step's log-probabilities equal the full teacher-forced forward pass.
    src = torch.tensor([[5, 9, 12, 7, EOS_ID], [8, 21, EOS_ID, PAD_ID, PAD_ID]])  # [B, S]
    tgt = torch.tensor([[BOS_ID, 4, 11, 30, 6, 17], [BOS_ID, 22, 13, 9, 5, 8]])  # [B, T]
    assert_steps_match_forward(model, src, tgt)
    # Search level: the same hypotheses and scores with the cache and without it.
    # Outputs longer than the cache's first capacity (16 positions) make it grow mid-search.
    cfg = DecodeConfig(beam=4, max_len_b=24, nbest=3)
    srcs = sources(10, seed=5)
    cached = translate(model, srcs, cfg)
    uncached = translate_uncached(model, srcs, cfg)
    for a, b in zip(cached, uncached):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)
    assert max(len(h.tokens) for a in cached for h in a) > 16


@pytest.mark.parametrize("block_rows", [1, 5])
def test_ranking_in_blocks_of_rows_gives_the_same_search(model, monkeypatch, block_rows):
    """Beam search ranks the candidates a block of rows at a time (log-probabilities made on demand per block):
    blocks of one sentence, or of a sentence and a bit, must find what one block of all rows finds."""
    import mtpipe.engine.search as md

    cfg = DecodeConfig(beam=4, max_len_b=6, nbest=2)
    srcs = sources(9, seed=11)
    whole = translate(model, srcs, cfg)
    monkeypatch.setattr(md, "_BLOCK_ROWS", block_rows)
    blocked = translate(model, srcs, cfg)
    for a, b in zip(whole, blocked):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-5)


def test_batches_by_tokens_respects_the_budget_and_covers_every_sentence():
    lengths = [3, 17, 5, 5, 9, 1, 30, 12, 2, 8]
    batches = batches_by_tokens(lengths, 24)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 24
        assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)
    assert [30] in [[lengths[i] for i in b] for b in batches]  # over the budget alone: a batch of its own


def test_batched_decoding_keeps_input_order_and_equals_one_at_a_time(model):
    srcs = sources(16, seed=7, lo=1, hi=20)
    cfg = DecodeConfig(beam=4, max_len_b=8, max_tokens=60)  # several batches of mixed lengths
    assert len(batches_by_tokens([len(s) + 1 for s in srcs], cfg.max_tokens)) > 2
    rows_per_step: list[int] = []
    from mtpipe.engine.variants import Prepared

    step = Prepared.step

    def recording_step(self, tokens, state, **kw):
        rows_per_step.append(len(tokens))
        return step(self, tokens, state, **kw)

    Prepared.step = recording_step  # the prepared model's step, which translate() runs
    try:
        batched = translate(model, srcs, cfg)
    finally:
        Prepared.step = step
    # Sentences leave the batch as they finish: the row count falls within a batch (not only at batch ends).
    assert any(b < a and b > 0 for a, b in zip(rows_per_step, rows_per_step[1:]))
    one_by_one = [translate(model, [s], cfg)[0] for s in srcs]
    for a, b in zip(batched, one_by_one):
        assert a[0].tokens == b[0].tokens
        assert a[0].score == pytest.approx(b[0].score, abs=1e-4)


def test_bf16_autocast_decodes(model):
    srcs = sources(6, seed=9)
    out = translate(model, srcs, DecodeConfig(beam=2, max_len_b=6, precision="bf16"))
    assert len(out) == len(srcs)
    for hyps in out:
        assert math.isfinite(hyps[0].score) and all(4 <= t < 40 or t == UNK_ID for t in hyps[0].tokens)


def test_the_cache_slots_table_reads_what_a_reordered_cache_holds():
    # DecoderState keeps every position's keys where the step wrote them and reorders a table of slots instead. Against
    # a cache physically reordered at every select: beam widening, reorders, sentences leaving, more positions than
    # the first allocation (growth), sentences joining (continuous batching) and the oldest positions dropped.
    from mtpipe.engine.cache import DecoderState

    g = torch.Generator().manual_seed(5)
    layers, heads, d = 2, 2, 3

    def fresh(n: int) -> DecoderState:
        return DecoderState(src_mask=torch.ones(n, 1, 1, 4, dtype=torch.bool),
                            cross=[(torch.zeros(n, heads, 4, d), torch.zeros(n, heads, 4, d))] * layers)

    state, ref = fresh(3), torch.zeros(0, layers, 3, heads, d)  # ref: [t, layers, R, h, d] in the rows' order
    for step in range(40):
        rows = state.slots.size(0) if state.slots is not None else 3
        k = torch.randn(layers, rows, heads, d, generator=g)
        state.write(k, -k)
        state = dataclasses.replace(state, length=state.length + 1)
        ref = torch.cat([ref, k[None]])
        keys, values = state.gathered()
        assert torch.equal(keys, ref) and torch.equal(values, -ref)
        # what a step reads: the flat cache's rows for each layer's positions, in the rows' order
        flat_k, _, index, _ = state.prefix(k[0], layers, heads, d, d, window=5)
        w = min(5, state.length)
        assert torch.equal(flat_k[index.reshape(-1)].view(layers, w, rows, heads, d), ref[-w:].transpose(0, 1))
        n = rows // state.beams
        if step == 0:  # the beam widens to 2 rows per sentence
            index_ = torch.arange(n).repeat_interleave(2)
            state, ref = state.select(index_, 2), ref[:, :, index_]
        elif step == 25:  # two sentences join (continuous batching), at this position
            state = state.admit(fresh(2))
            ref = torch.cat([ref, torch.zeros(ref.size(0), layers, 4, heads, d)], dim=2)
            assert torch.equal(state.prefix(k[0], layers, heads, d, d)[3][-4:, 0, 0],
                               torch.zeros(4, state.length, dtype=torch.bool))  # their earlier positions are masked
            ref[:, :, -4:] = state.gathered()[0][:, :, -4:]  # (whatever is there is masked)
        else:  # each sentence keeps 2 rows, drawn from its own rows; one sentence leaves at step 10, the first two
            # (the ones before the joiners) at step 30
            keep = [i for i in range(n) if not (step == 10 and i == 1 or step == 30 and i < 2)]
            pick = torch.randint(0, 2, (len(keep), 2), generator=g) + torch.tensor(keep)[:, None] * 2
            index_ = pick.view(-1)
            state, ref = state.select(index_), ref[:, :, index_]
            if state.start is None and step > 25:
                ref = ref[ref.size(0) - state.length:]  # the oldest positions were dropped with their sentences
    assert state.length == 40 - 26  # the sentences that left at step 30 took the positions before the joiners' along


def test_compiled_step_decodes_what_the_eager_step_decodes(model, monkeypatch):
    # decode.compile: the model's step (Transformer.step) compiled, from the third step on (aot, float32 on CPU:
    # packaged ahead of time, mtpipe.engine.step_package; bf16: torch.compile). Sentences of mixed lengths finish at
    # different steps, so the batch runs with several sentences and then with one alone (run as two copies of itself,
    # in the same graph); the beam search must find the same hypotheses with the same scores. float32 with the graph
    # gathering the cached keys/values itself (the tiny model's rows are short: forced), bf16 below with them
    # gathered before it.
    import torch._dynamo.config
    import torch._inductor.config
    from torch._dynamo.utils import counters

    from mtpipe.engine import runners
    from mtpipe.engine.translate import MtpipeEngine
    from mtpipe.engine.variants import prepare

    cpu = torch.device("cpu")
    monkeypatch.setattr(runners, "_GATHER_IN_GRAPH_BYTES", 0)
    # the longest source alone: its outputs, which the length limit (source + 10) ends last, run alone at the end
    srcs = sources(6, seed=11, lo=2, hi=14) + sources(1, seed=12, lo=15, hi=16)
    cfg = DecodeConfig(beam=3, max_len_b=10, max_tokens=1000, nbest=3)
    eager = translate(model, srcs, cfg)
    source = copy.deepcopy(model)
    compiled = prepare(source, "fp32", cpu, compile="aot")
    # the variant holds weights of its own: a graph frozen on them never meets weights changed in place
    assert not {id(t) for t in compiled.model.parameters()} & {id(t) for t in source.parameters()}
    inner, calls, sentences, settings, entered = compiled.compiled.fn, [], [], [], []

    def call(*args):  # the rows and sentences of each call, and the settings it runs (and may trace a graph) under
        calls.append(args[0].size(0))
        half = args[0].size(0) // 2  # x [R, 1, D]; src_mask [n, 1, 1, S]; True: a sentence and its copy
        sentences.append((args[5].size(0), torch.equal(args[0][:half], args[0][half:])))
        settings.append((torch._inductor.config.freezing, torch._dynamo.config.specialize_float))
        return inner(*args)

    compiled.compiled.fn = call
    real_settings = runners._settings
    monkeypatch.setattr(runners, "_settings", lambda frozen: entered.append(frozen) or real_settings(frozen))
    graphs = counters["stats"]["unique_graphs"]
    out = decode_prepared(compiled, srcs, cfg)
    assert max(calls) == 7 * 3 and min(calls) < 7 * 3  # the compiled step ran, on the whole batch and as it shrank
    # ... down to the last sentence, which ran as two (torch would specialise a size of 1): one graph for them all
    assert (2, True) in sentences and min(n for n, _ in sentences) == 2 and calls[-1] == 2 * 3
    # one package for them all (none was on disk), and no torch.compile graph
    assert isinstance(inner, PackagedStep) and inner.built == 1 and counters["stats"]["unique_graphs"] == graphs
    # Its settings (weights frozen into the graph, the step's floats constants) were in force at every call, where
    # a graph may be traced, and were entered once around the whole decode, not by every step.
    assert set(settings) == {(True, True)} and entered == [True]
    # So does an engine holding the prepared model (stdin's lines, a server's requests): once per call.
    MtpipeEngine(compiled, cpu, "fp32", cfg.max_tokens).translate(srcs, DecodeRules.from_config(cfg))
    assert set(settings) == {(True, True)} and entered == [True, True]
    assert (torch._inductor.config.freezing, torch._dynamo.config.specialize_float) == (False, False)  # left after
    # The compiled step belongs to the prepared variant: the model it was prepared from, prepared without
    # decode.compile, decodes eagerly.
    ran = len(calls)
    assert translate(source, srcs[:2], cfg)[0][0].tokens == eager[0][0].tokens and len(calls) == ran
    for a, b in zip(eager, out):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)

    monkeypatch.setattr(runners, "_GATHER_IN_GRAPH_BYTES", 1 << 30)
    cfg16 = dataclasses.replace(cfg, precision="bf16", nbest=1)
    eager16 = translate(model, srcs, cfg16)
    out16 = translate(model, srcs, dataclasses.replace(cfg16, compile="jit"))
    same = sum(a[0].tokens == b[0].tokens for a, b in zip(eager16, out16))
    assert same >= len(srcs) - 1  # bf16 rounding differs between the two: a near tie may go the other way

    # A prepared model is a snapshot of the weights it was prepared from (on CPU the graph holds them as constants,
    # inductor's freezing). After an in-place update of the weights, preparing again builds a package of the new
    # weights and decodes with them (not a mix of new cross-attention keys and the old layers), while the earlier
    # prepared model goes on decoding with the old ones.
    expected = update_in_place(source, model, srcs, cfg, eager)
    again = prepare(source, "fp32", cpu, compile="aot")
    renewed = decode_prepared(again, srcs, cfg)
    assert [[h.tokens for h in hyps] for hyps in renewed] == [[h.tokens for h in hyps] for hyps in expected]
    assert again.compiled.fn.built == 1  # a package of its own: the new weights' key
    ran = len(calls)
    old = decode_prepared(compiled, srcs, cfg)
    assert len(calls) > ran  # the earlier compiled step ran ...
    assert [[h.tokens for h in hyps] for hyps in old] == [[h.tokens for h in hyps] for hyps in eager]  # ... as before

    # lone_graph (mtpipe serve, stdin): the lone sentence in a graph of its own, the same hypotheses
    torch.compiler.reset()  # the graphs above (of the same code) out of the way, as a new process would start
    monkeypatch.setattr(runners, "_GATHER_IN_GRAPH_BYTES", 0)  # the variant of the first package above
    own = prepare(copy.deepcopy(model), "fp32", cpu, compile="aot", lone_graph=True)
    inner_own, own_sentences = own.compiled.fn, []
    own.compiled.fn = lambda *args: own_sentences.append(args[5].size(0)) or inner_own(*args)
    graphs = counters["stats"]["unique_graphs"]
    alone = decode_prepared(own, srcs, cfg)
    # the several sentences' package (the same weights) loaded from disk, the lone sentence's built; no graph
    assert min(own_sentences) == 1 and inner_own.built == 1 and counters["stats"]["unique_graphs"] == graphs
    assert [[h.tokens for h in hyps] for hyps in alone] == [[h.tokens for h in hyps] for hyps in eager]


def test_graphed_step_decodes_what_the_eager_step_decodes(model, monkeypatch):
    """decode.cuda_graphs: the step on fixed-shape buffers (rows, cached positions and source positions rounded up to
    powers of two, the extra ones masked or never read), run here without recording graphs, finds the eager step's
    hypotheses and scores: sentences of mixed lengths (sources past the smallest source bucket), outputs past two
    cache buckets, a batch that shrinks through the row buckets."""
    from mtpipe.engine import cuda_graphs

    srcs = sources(7, seed=12, lo=2, hi=14) + sources(2, seed=13, lo=34, hi=40)  # source buckets 32 and 64
    cfg = DecodeConfig(beam=3, max_len_b=30, max_tokens=120, nbest=3)  # the short and the long in batches apart
    eager = translate(model, srcs, cfg)
    source = copy.deepcopy(model)
    twin = graphed(source)
    seen: list[tuple[int, tuple]] = []  # (rows, bucket) of every graphed step
    real_call = cuda_graphs.GraphedStep.__call__

    def counting(self, x, state):
        n = state.src_mask.size(0)
        key = (cuda_graphs.bucket(n), x.size(0) // n, cuda_graphs.bucket(state.src_mask.size(-1), 32),
               cuda_graphs.bucket(state.length, 16))
        seen.append((x.size(0), key))
        return real_call(self, x, state)

    monkeypatch.setattr(cuda_graphs.GraphedStep, "__call__", counting)
    out = decode_prepared(twin, srcs, cfg)
    buckets = {key for _, key in seen}
    assert {key[3] for key in buckets} >= {16, 32} and {key[2] for key in buckets} == {32, 64}
    assert any(rows < key[0] * key[1] for rows, key in seen)  # padded rows
    assert len(twin.graphs.buckets) == len(buckets) and not any(b.graph for b in twin.graphs.buckets.values())
    for a, b in zip(eager, out):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)
    # A later decode on the same prepared model (an engine's next call) keeps the graphs made so far.
    kept, buckets_before = twin.graphs, dict(twin.graphs.buckets)
    assert decode_prepared(twin, srcs[:2], cfg)[0][0].tokens == eager[0][0].tokens
    assert twin.graphs is kept and all(kept.buckets.get(k) is b for k, b in buckets_before.items())
    # Graphs read the weights of the variant they were made for, a snapshot: after the weights change in place,
    # preparing again gives graphs of their own (new buckets), which decode with the new weights as the eager step
    # does.
    expected = update_in_place(source, model, srcs, cfg, eager)
    renewed, ran = graphed(source), len(seen)
    got = decode_prepared(renewed, srcs, cfg)
    assert len(seen) > ran and renewed.graphs.buckets
    assert not {id(b) for b in renewed.graphs.buckets.values()} & {id(b) for b in kept.buckets.values()}
    for a, b in zip(expected, got):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)


def test_graphed_step_takes_sentences_joining_a_running_search(model):
    """Continuous batching with decode.cuda_graphs: rows that joined later (their own start slot, masked earlier
    slots) decode as they would alone, through the graphs' fixed-shape buffers."""
    from mtpipe.engine.search import DecodeRules
    from mtpipe.engine.streaming import StreamDecoder

    rules = DecodeRules(beam=4, nbest=2, penalty=LengthPenalty("gnmt", 0.6), max_len_b=24)
    srcs = sources(8, seed=21)
    alone = [translate_batches(model, [s], rules, max_tokens=1000)[0] for s in srcs]
    twin = graphed(model)
    stream = StreamDecoder(twin, rules, max_tokens=10_000)
    got: dict[int, list] = {}
    arrivals = {0: [0, 1], 2: [2, 3], 5: [4], 9: [5, 6, 7]}
    step, joined_late = 0, False
    with torch.inference_mode():
        while len(got) < len(srcs):
            for i in arrivals.get(step, []):
                stream.add(i, srcs[i])
            got.update(stream.step())
            state = stream.search.state
            joined_late |= state is not None and state.start is not None
            step += 1
            assert step < 200
    assert joined_late and twin.graphs.buckets
    for i, hyps in enumerate(alone):
        assert [h.tokens for h in got[i]] == [h.tokens for h in hyps], i
        assert [h.score for h in got[i]] == pytest.approx([h.score for h in hyps], abs=1e-4)


@pytest.mark.parametrize("failing", ["record", "allocate"])
def test_a_graph_that_cannot_be_made_falls_back_to_the_eager_step(model, capsys, monkeypatch, failing):
    """Where recording fails (here: a CPU, where torch has no CUDA streams; on a GPU a driver or an operation that
    does not allow it) or a bucket's buffers do not fit in GPU memory, decoding says so once and goes on with the
    eager step: the same translations."""
    from mtpipe.engine import cuda_graphs

    srcs = sources(4, seed=41)
    cfg = DecodeConfig(beam=2, max_len_b=8)
    eager = translate(model, srcs, cfg)
    twin = graphed(model, capture=failing == "record")
    if failing == "allocate":
        def no_memory(self, key, x):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")

        monkeypatch.setattr(cuda_graphs.GraphedStep, "_allocate", no_memory)
    out = decode_prepared(twin, srcs, cfg)
    assert [[h.tokens for h in a] for a in out] == [[h.tokens for h in a] for a in eager]
    assert [[h.score for h in a] for a in out] == [[h.score for h in a] for a in eager]
    err = capsys.readouterr()
    warnings = [line for line in (err.out + err.err).splitlines() if "decode.cuda_graphs" in line]
    assert len(warnings) == 1 and "could not be made" in warnings[0] and "eager step" in warnings[0]
    assert ("out of memory" in warnings[0]) == (failing == "allocate")
    assert not twin.graphs.takes(1) and not twin.graphs.buckets


def test_graphed_step_serves_two_searches_taking_turns(model):
    """Two continuous-batching streams (``mtpipe serve`` keeps one per distinct beam / alpha / nbest) step in turn on
    one model with decode.cuda_graphs: the buckets they share (same shapes) hold one stream's sentences, then the
    other's, and each stream still decodes as its sentences would alone."""
    from mtpipe.engine.search import DecodeRules
    from mtpipe.engine.streaming import StreamDecoder

    rules = [DecodeRules(beam=2, max_len_b=12), DecodeRules(beam=2, max_len_b=12, penalty=LengthPenalty("gnmt", 1.0))]
    srcs = [sources(3, seed=31), sources(3, seed=32)]
    alone = [[translate_batches(model, [s], r, max_tokens=1000)[0] for s in ss] for r, ss in zip(rules, srcs)]
    twin = graphed(model)
    streams = [StreamDecoder(twin, r, max_tokens=10_000) for r in rules]
    got: list[dict] = [{}, {}]
    with torch.inference_mode():
        for stream, ss in zip(streams, srcs):
            for i, s in enumerate(ss):
                stream.add(i, s)
        for _ in range(100):
            for stream, g in zip(streams, got):
                if len(stream):
                    g.update(stream.step())
    for want, g in zip(alone, got):
        for i, hyps in enumerate(want):
            assert [h.tokens for h in g[i]] == [h.tokens for h in hyps], i
            assert [h.score for h in g[i]] == pytest.approx([h.score for h in hyps], abs=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="optional: needs a CUDA GPU (CPU runs check the same buckets unrecorded, above)")
@pytest.mark.parametrize("precision,variant", [("fp32", ""), ("bf16", ""), ("fp32", "fixnorm")])
def test_recorded_cuda_graphs_decode_what_the_eager_step_decodes(model, precision, variant):
    """decode.cuda_graphs on a GPU: the steps replayed from recorded graphs (several buckets, a batch that shrinks)
    find the eager step's hypotheses, and every bucket's graph was recorded once; also for the pre-norm, ScaleNorm +
    FixNorm, learned-positions variant (its output projection normalises the embedding inside the graph)."""
    if variant:
        torch.manual_seed(0)
        model = Transformer(ModelConfig(preset="tiny", dropout=0.0, max_positions=128, norm_position="pre",
                                        norm="scale", fixnorm=True, positions="learned"), 40).eval()
    from mtpipe.engine.variants import prepare

    gpu = copy.deepcopy(model).cuda()
    srcs = sources(7, seed=12, lo=2, hi=14) + sources(2, seed=13, lo=34, hi=40)
    cfg = DecodeConfig(beam=3, max_len_b=30, max_tokens=120, nbest=3, precision=precision, device="cuda")
    eager = translate(gpu, srcs, dataclasses.replace(cfg, cuda_graphs=False), device="cuda")
    prepared = prepare(gpu, precision, torch.device("cuda"), cuda_graphs=True)
    out = decode_prepared(prepared, srcs, cfg, device="cuda")
    assert prepared.graphs is not None and len(prepared.graphs.buckets) > 3
    assert all(b.graph is not None for b in prepared.graphs.buckets.values())
    same = sum([h.tokens for h in a] == [h.tokens for h in b] for a, b in zip(eager, out))
    assert same >= len(srcs) - (0 if precision == "fp32" else 2)  # bf16: a near tie may go the other way
    for a, b in zip(eager, out):
        if [h.tokens for h in a] == [h.tokens for h in b]:
            assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-3 if precision == "fp32" else 0.1)


def test_cuda_graphs_apply_on_a_gpu_only_and_not_to_restricted_attention(model):
    """decode.cuda_graphs: a model prepared for a GPU gets the graphed step (its graphs made at first use, so nothing
    here needs a GPU); not on CPU, not with restricted self-attention, and not with decode.compile, whose step runs
    instead."""
    from mtpipe.engine.cuda_graphs import GraphedStep
    from mtpipe.engine.variants import prepare

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert isinstance(prepare(copy.deepcopy(model), "fp32", gpu, cuda_graphs=True).graphs, GraphedStep)
    assert prepare(copy.deepcopy(model), "fp32", gpu, cuda_graphs=False).graphs is None
    assert prepare(model, "fp32", cpu, cuda_graphs=True).graphs is None  # decode.cuda_graphs has no effect on CPU
    torch.manual_seed(0)
    windowed = Transformer(ModelConfig(preset="tiny", dropout=0.0, attention_window=3), 40).eval()
    # its window is the last r cached positions, which padding would move
    assert prepare(windowed, "fp32", gpu, cuda_graphs=True).graphs is None
    compiled = prepare(copy.deepcopy(model), "fp32", gpu, compile="jit", cuda_graphs=True)
    assert compiled.graphs is None and compiled.compiled is not None  # decode.compile's step runs instead


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_the_engine_makes_its_precision_copy_once(model, precision, monkeypatch):
    """A bf16 or int8 engine copies (quantises) the weights once, when it opens, not per call (stdin's lines and a
    server's requests are many calls), and decodes what the one-off path decodes."""
    import mtpipe.engine.variants as variants
    from mtpipe.engine.translate import MtpipeEngine

    cfg = DecodeConfig(beam=2, max_len_b=6, precision=precision, threads=1)
    loaded = copy.deepcopy(model)
    engine = MtpipeEngine.open(loaded, cfg)
    prepared: list[object] = []
    monkeypatch.setattr(variants, "prepare", lambda *a, **k: prepared.append(a))  # no call may prepare again
    rules = DecodeRules.from_config(cfg)
    srcs = sources(4, seed=5)
    first = engine.translate(srcs[:2], rules)
    second = engine.translate(srcs[2:], rules)
    assert prepared == []
    assert next(loaded.parameters()).dtype == torch.float32  # the loaded model is left as it was
    monkeypatch.undo()
    want = translate(model, srcs[:2], cfg) + translate(model, srcs[2:], cfg)  # the same batches (int8 quantises
    for got, ref in zip(first + second, want):  # each batch's activations with one scale)
        assert [h.tokens for h in got] == [h.tokens for h in ref]
        assert [h.score for h in got] == pytest.approx([h.score for h in ref], abs=1e-5)


def test_a_failed_compile_is_one_clear_error(model):
    # What a machine without a C++ compiler gets from torch.compile (an InductorError, a TorchDynamoException) becomes
    # an MtpipeError that says what failed and what to do: the CLI prints one line and exits non-zero.
    from mtpipe.engine.variants import prepare

    broken = prepare(copy.deepcopy(model), "fp32", torch.device("cpu"), compile="jit")

    def no_compiler(*args):
        raise torch._dynamo.exc.TorchDynamoException("InvalidCxxCompiler: No working C++ compiler found\nmore")

    broken.compiled.fn = no_compiler
    with pytest.raises(MtpipeError, match=r"decode.compile: torch.compile could not build the decoder step "
                                          r"\(InvalidCxxCompiler: No working C\+\+ compiler found\); decode without"):
        decode_prepared(broken, sources(2, seed=3, lo=4, hi=8), DecodeConfig(beam=2, max_len_b=6, compile="jit"))


def test_a_packaged_step_serves_every_size_its_export_allowed(model, monkeypatch, capsys):
    # A package built on one batch's first compiled step (2 sentences, beam 2) decodes other batches (7 sentences,
    # beam 3, longer outputs) as eager decoding does; greedy search, where rows and sentences are one size, gets a
    # package of its own (one exported for beams would refuse its rows, and one for greedy search its beams').
    # With MTPIPE_CACHE_MAX_GB=0 the cache keeps only the package just built: the greedy one's build removes the
    # beams' (already loaded, so still decoding), and says so.
    import json
    import os
    import random

    from mtpipe.engine import step_package
    from mtpipe.engine.variants import prepare

    cache = Path(os.environ["MTPIPE_CACHE_DIR"]) / "bounded"
    monkeypatch.setenv("MTPIPE_CACHE_DIR", str(cache))
    monkeypatch.setenv("MTPIPE_CACHE_MAX_GB", "0")
    compiled = prepare(copy.deepcopy(model), "fp32", torch.device("cpu"), compile="aot")
    step = compiled.compiled.fn
    few, many = sources(2, seed=21, lo=3, hi=6), sources(7, seed=22, lo=2, hi=14)
    for srcs, beam in ((few, 2), (many, 3), (many, 1), (few, 1)):
        cfg = DecodeConfig(beam=beam, max_len_b=8, max_tokens=1000, compile="aot")
        got = decode_prepared(compiled, srcs, cfg)
        want = translate(model, srcs, dataclasses.replace(cfg, compile=False))
        assert [h[0].tokens for h in got] == [h[0].tokens for h in want], (len(srcs), beam)
        assert [h[0].score for h in got] == pytest.approx([h[0].score for h in want], abs=1e-4)
    assert isinstance(step, PackagedStep) and sorted(v[2] for v in step.runners) == [False, True]
    assert all(r is not None for r in step.runners.values()) and step.built == 2
    packages = list((cache / "decode-step").glob("*.pt2"))
    assert len(packages) == 1 and len(list((cache / "decode-step").glob("*.json"))) == 1
    # the package and its record have the permissions a plain open gives (the umask's), as every artifact has
    from mtpipe.atomic import _umask
    assert {p.stat().st_mode & 0o777 for p in (*packages, packages[0].with_suffix(".json"))} == {0o666 & ~_umask()}
    assert re.search(r"removed 1 least recently used packaged step\(s\) \(\d+ MB\) from", capsys.readouterr().err)

    # A package is native code and frozen weights that run unchecked: every load hashes it against the record
    # written beside it when it was built. Intact, a new model (as a new process) loads it without a word ...
    [package] = packages  # the greedy one, built last
    assert json.loads(package.with_suffix(".json").read_text())["content"] == step_package.content_hash(package)
    cfg = DecodeConfig(beam=1, max_len_b=8, max_tokens=1000, compile="aot")
    want = [h[0].tokens for h in translate(model, many, dataclasses.replace(cfg, compile=False))]

    def decode_anew() -> tuple[PackagedStep, list[list[int]]]:
        again = prepare(copy.deepcopy(model), "fp32", torch.device("cpu"), compile="aot")
        return again.compiled.fn, [h[0].tokens for h in decode_prepared(again, many, cfg)]

    step, got = decode_anew()
    assert step.built == 0 and got == want and "decode.compile" not in capsys.readouterr().err
    # ... and changed in place (4 KB in the middle overwritten, its size kept: loaded silently, it changed
    # translations), it is never run but built again, with one warning naming it (a truncated one: the unit test
    # below).
    size, before = package.stat().st_size, package.read_bytes()
    with open(package, "r+b") as f:
        f.seek(size // 2)
        f.write(random.Random(0).randbytes(4096))
    assert package.stat().st_size == size and package.read_bytes() != before
    step, got = decode_anew()
    err = capsys.readouterr().err
    assert err.count(f"decode.compile: {package}: its bytes do not match the content hash recorded when it was "
                     "built (modified or damaged); building it again") == 1
    assert "could not package" not in err and step.built == 1 and got == want
    assert step_package.verify(package)["content"] == step_package.content_hash(package)  # the new one, recorded


def test_the_package_cache_removes_the_least_recently_used_beyond_its_bound(tmp_path, monkeypatch):
    # mtpipe.engine.step_package.prune: oldest use first, down to the bound; never the package just built, one another
    # process holds the lock of (loading or building it), or a file mtpipe did not name; a killed build's temporary
    # files go once they are a day old.
    import fcntl
    import os
    import time

    from mtpipe.engine import step_package

    now = time.time()

    def package(i: int, used_hours_ago: float, size: int) -> Path:
        p = tmp_path / f"{i:032x}.pt2"
        p.write_bytes(b"x" * size)
        p.with_suffix(".json").write_text("{}")
        os.utime(p, (now - used_hours_ago * 3600,) * 2)
        return p

    oldest, locked, old, recent, kept = (package(i, h, 100) for i, h in enumerate((50, 40, 30, 20, 10)))
    foreign = [tmp_path / "notes.pt2", tmp_path / "mine.txt", tmp_path / f"{9:032x}.pt2.bak"]
    for f in foreign:
        f.write_bytes(b"y" * 1000)
    stale, fresh = tmp_path / f"{7:032x}.ab12cd.partial.pt2", tmp_path / f"{8:032x}.ab12cd.partial"
    for f, hours in ((stale, 25), (fresh, 1)):
        f.write_bytes(b"z")
        os.utime(f, (now - hours * 3600,) * 2)
    # a failed build's lock and ranges (no package): removed once no process holds the lock
    failed, building = tmp_path / f"{5:032x}.pt2", tmp_path / f"{6:032x}.pt2"
    for f in (failed, building):
        f.with_suffix(".lock").touch()
        f.with_suffix(".json").write_text("{}")
    with open(locked.with_suffix(".lock"), "a") as held, open(building.with_suffix(".lock"), "a") as held2:
        fcntl.flock(held, fcntl.LOCK_EX)
        fcntl.flock(held2, fcntl.LOCK_EX)
        assert step_package.prune(tmp_path, keep=kept, limit=300) == (2, 200)
    left = {p.name for p in tmp_path.iterdir()}
    for gone in (oldest, old, failed):  # with its ranges and its lock
        assert not ({gone.name, gone.with_suffix(".json").name, gone.with_suffix(".lock").name} & left)
    assert {locked.name, recent.name, kept.name, fresh.name, locked.with_suffix(".lock").name} <= left
    assert {building.with_suffix(".lock").name, building.with_suffix(".json").name} <= left and stale.name not in left
    assert all(f.exists() for f in foreign)
    # used most recently = kept longest; the one just built survives even a bound of 0
    os.utime(locked, (now,) * 2)
    assert step_package.prune(tmp_path, keep=kept, limit=0) == (2, 200)
    assert sorted(p.name for p in tmp_path.glob("*.pt2")) == sorted([kept.name, "notes.pt2"])
    assert step_package.prune(tmp_path, keep=kept, limit=10**9) == (0, 0)
    assert not building.with_suffix(".lock").exists()  # its lock is free now: the build failed
    # the bound: decode.package_cache_gb (default 5), MTPIPE_CACHE_MAX_GB over it; a bad value is a one-line error
    monkeypatch.delenv("MTPIPE_CACHE_MAX_GB", raising=False)
    assert step_package.PackageCache().limit_bytes() == 5 * 10**9
    assert step_package.PackageCache(max_gb=2).limit_bytes() == 2 * 10**9
    monkeypatch.setenv("MTPIPE_CACHE_MAX_GB", "0.5")
    assert step_package.PackageCache(max_gb=2).limit_bytes() == 5 * 10**8
    for bad in ("-1", "lots", "nan"):
        monkeypatch.setenv("MTPIPE_CACHE_MAX_GB", bad)
        with pytest.raises(MtpipeError, match=r"MTPIPE_CACHE_MAX_GB: .* is not a size in GB"):
            step_package.PackageCache().limit_bytes()
    with pytest.raises(MtpipeError, match="decode.package_cache_gb"):
        DecodeConfig(package_cache_gb=-1)


def test_a_package_lock_removed_while_a_process_waits_on_it_is_not_held_twice(tmp_path, monkeypatch):
    # prune removes a package's lock file (holding it); a process that was waiting on that file must then lock the
    # one at the path now, else it and a newcomer (who creates a new file there) would both "hold" the lock.
    import fcntl
    import threading
    import time

    from mtpipe.engine import step_package

    path = tmp_path / f"{1:032x}.lock"
    waiting, inside, done = threading.Event(), threading.Event(), threading.Event()
    flock = fcntl.flock

    def flock_noting_the_wait(f, op):
        if threading.current_thread().name == "waiter" and not op & fcntl.LOCK_NB:
            waiting.set()
        return flock(f, op)

    monkeypatch.setattr(fcntl, "flock", flock_noting_the_wait)

    def waiter() -> None:
        with step_package._locked(path, wait=True) as held:
            assert held
            inside.set()
            done.wait(10)

    with step_package._locked(path, wait=True) as held:
        assert held
        thread = threading.Thread(target=waiter, name="waiter")
        thread.start()
        assert waiting.wait(10)
        time.sleep(0.2)  # let it block in flock on this file
        step_package._remove(path.with_suffix(".pt2"))
    assert inside.wait(10) and path.exists()
    with step_package._locked(path, wait=False) as newcomer:
        assert not newcomer  # the waiter holds the file at the path
    done.set()
    thread.join(10)
    with step_package._locked(path, wait=False) as newcomer:
        assert newcomer


def test_a_step_that_cannot_be_packaged_runs_through_torch_compile(model, monkeypatch, capsys):
    # decode.compile in float32 on CPU packages the step ahead of time (mtpipe.engine.step_package); where the export fails
    # (an operation it cannot trace, a read-only cache) one warning says so and torch.compile's step decodes instead,
    # the same hypotheses as eager decoding; nothing is left in the cache.
    import os

    monkeypatch.setenv("MTPIPE_CACHE_DIR", str(Path(os.environ["MTPIPE_CACHE_DIR"]) / "failed"))

    def no_export(*args, **kwargs):
        raise RuntimeError("an operator export cannot trace\nmore")

    monkeypatch.setattr(torch.export, "export", no_export)
    srcs, cfg = sources(3, seed=5, lo=3, hi=9), DecodeConfig(beam=2, max_len_b=6, compile="aot")
    compiled = copy.deepcopy(model)
    out = translate(compiled, srcs, cfg)
    err = capsys.readouterr().err
    assert err.count("could not package the decoder step ahead of time (an operator export cannot trace)") == 1
    assert "compiling it in this process instead" in err
    assert [h[0].tokens for h in out] == [h[0].tokens for h in translate(model, srcs, dataclasses.replace(cfg,
                                                                                                      compile=False))]
    assert not list((Path(os.environ["MTPIPE_CACHE_DIR"]) / "decode-step").glob("*.pt2"))


def test_a_packaged_step_is_keyed_by_its_weights_and_environment(model, monkeypatch, capsys):
    # decode.compile=aot packages the step (float32 on CPU; elsewhere it is jit, with a note); jit is torch.compile's
    # step in every process, nothing packaged, and decodes as the eager step does (aot: the tests above).
    from mtpipe.engine import step_package
    from mtpipe.engine.variants import prepare

    cpu = torch.device("cpu")
    assert isinstance(prepare(copy.deepcopy(model), "fp32", cpu, compile="aot").compiled.fn, PackagedStep)
    capsys.readouterr()
    bf16 = prepare(copy.deepcopy(model), "bf16", cpu, compile="aot")
    assert bf16.compiled is not None and not isinstance(bf16.compiled.fn, PackagedStep)
    assert "decode.compile=aot: packaged ahead of time for float32 on CPU only" in "".join(capsys.readouterr())
    plain = prepare(copy.deepcopy(model), "fp32", cpu, compile="jit")
    assert plain.compiled is not None and not isinstance(plain.compiled.fn, PackagedStep)
    srcs, cfg = sources(3, seed=8, lo=3, hi=9), DecodeConfig(beam=2, max_len_b=6)
    want = translate(model, srcs, cfg)
    got = decode_prepared(plain, srcs, cfg)
    assert [h[0].tokens for h in got] == [h[0].tokens for h in want]
    assert [h[0].score for h in got] == pytest.approx([h[0].score for h in want], abs=1e-4)

    # A package holds the weights it was built with and code for one CPU dispatch and one source of mtpipe's model
    # and engine: another model's weights (one value changed), an AVX2-restricted process or other code must not
    # load it.
    digest = step_package.weights_digest(model)
    variant = (False, False, 2, (("torch.float32", 3),))
    key = step_package.package_key(digest, variant)
    assert step_package.weights_digest(copy.deepcopy(model)) == digest  # the same weights, another object
    other = copy.deepcopy(model)
    with torch.no_grad():
        next(other.decoder[0].parameters()).view(-1)[0] += 1e-6
    assert step_package.weights_digest(other) != digest
    assert step_package.package_key(digest, (True,) + variant[1:]) != key  # another input variant
    assert step_package.package_key(digest, variant) == key  # (the same inputs, the same key)
    monkeypatch.setattr(step_package, "_source_digest", lambda: "other code")
    assert step_package.package_key(digest, variant) != key
    monkeypatch.undo()
    with platform.assume_cpu(capability="AVX2-restricted"):  # code for another CPU: another package
        assert step_package.package_key(digest, variant) != key
    with platform.assume_cpu(isa_limit="AVX2"):
        assert step_package.package_key(digest, variant) != key
    # the place: decode.package_cache, MTPIPE_CACHE_DIR over it
    monkeypatch.delenv("MTPIPE_CACHE_DIR", raising=False)
    assert step_package.PackageCache("/configured").path() == Path("/configured") / "decode-step"
    monkeypatch.setenv("MTPIPE_CACHE_DIR", "/somewhere")
    assert step_package.PackageCache("/configured").path() == Path("/somewhere") / "decode-step"


def test_a_package_without_a_matching_record_is_not_verified(tmp_path):
    # What step_package.verify refuses (each a reason to build the package again): no record, an unreadable one, one
    # without a content hash (an older mtpipe's), other bytes than it records; a truncated package among them.
    import json

    from mtpipe.engine import step_package

    package = tmp_path / ("0" * 32 + ".pt2")
    package.write_bytes(b"package bytes" * 1000)
    record = package.with_suffix(".json")
    with pytest.raises(step_package.Unverified, match=r"no record \(0+\.json\) beside it"):
        step_package.verify(package)
    record.write_text("{not json")
    with pytest.raises(step_package.Unverified, match="is unreadable"):
        step_package.verify(package)
    record.write_text('{"ranges": [[0, 0, 2, null]]}')
    with pytest.raises(step_package.Unverified, match="holds no content hash"):
        step_package.verify(package)
    record.write_text(json.dumps({"ranges": [[0, 0, 2, None]], "content": step_package.content_hash(package)}))
    assert step_package.verify(package)["ranges"] == [[0, 0, 2, None]]
    data = package.read_bytes()
    package.write_bytes(data[:100] + b"X" + data[101:])
    with pytest.raises(step_package.Unverified, match="do not match the content hash"):
        step_package.verify(package)
    package.write_bytes(data[:-1])
    with pytest.raises(step_package.Unverified, match="do not match the content hash"):
        step_package.verify(package)


def test_compile_is_refused_where_it_does_not_apply():
    with pytest.raises(MtpipeError, match="decode.compile: applies to precision fp32 and bf16"):
        DecodeConfig(compile=True, precision="int8")
    with pytest.raises(MtpipeError, match="decode.compile: applies to engine mtpipe"):
        DecodeConfig(compile=True, engine="ctranslate2")


def test_decoding_context_keeps_cudnn_attention_out_on_gpus_only():
    """On a GPU, decoding runs without cuDNN's attention kernel (a new execution graph per shape, and every step's
    keys are one longer), with the others allowed; on CPU the backend switches stay as they are; both restored after.
    The switches are process-wide flags that exist without a GPU, so this runs anywhere (CUDA autocast does not:
    a CPU-only torch turns it off with a warning, so the bf16 half is checked on CPU)."""
    from mtpipe.engine.variants import decoding_context

    cuda = torch.backends.cuda
    before = (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(),
              cuda.math_sdp_enabled())
    assert before[0], "torch's default allows cuDNN attention; this test needs that default"
    for precision in ("fp32", "bf16"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # CUDA autocast on a CPU-only torch: "disabled"
            with decoding_context(torch.device("cuda", 0), precision):
                assert not cuda.cudnn_sdp_enabled()
                assert cuda.flash_sdp_enabled() and cuda.mem_efficient_sdp_enabled() and cuda.math_sdp_enabled()
        with decoding_context(torch.device("cpu"), precision):
            assert cuda.cudnn_sdp_enabled()
            assert torch.is_autocast_enabled("cpu") == (precision == "bf16")
        assert (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(),
                cuda.math_sdp_enabled()) == before
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("stop", ["bound", "finished"])
def test_sentences_joining_a_running_search_decode_as_they_would_alone(model, stop):
    """Continuous batching (mtpipe.engine.streaming): sentences that join a beam search already running, at different steps
    and beside sentences that leave, get each the hypotheses and scores of decoding it in a batch of its own -- their
    positions count from their own start, the cache slots from before it are masked, and the slots that no remaining
    row uses are dropped as the oldest sentences leave."""
    from mtpipe.engine.search import DecodeRules
    from mtpipe.engine.streaming import StreamDecoder
    from mtpipe.engine.variants import prepare

    rules = DecodeRules(beam=4, nbest=2, penalty=LengthPenalty("gnmt", 0.6), max_len_b=24, stop=stop)
    srcs = sources(12, seed=11)
    alone = [translate_batches(model, [s], rules, max_tokens=1000)[0] for s in srcs]
    stream = StreamDecoder(prepare(model, "fp32", torch.device("cpu")), rules, max_tokens=10_000)
    got: dict[int, list] = {}
    arrivals = {0: [0, 1, 2], 1: [3], 3: [4, 5], 6: [6], 7: [7, 8], 12: [9], 13: [10, 11]}  # step -> sentences
    step, joined_late, shrank = 0, False, False
    with torch.inference_mode():
        while len(got) < len(srcs):
            for i in arrivals.get(step, []):
                stream.add(i, srcs[i])
            for key, hyps in stream.step():
                got[key] = hyps
            state = stream.search.state
            if state is not None:
                joined_late |= state.start is not None
                shrank |= state.start is not None and state.length < step + 1
            step += 1
            assert step < 200
    assert joined_late and shrank  # rows of different starts shared the batch, and old slots were dropped
    for i, hyps in enumerate(alone):
        assert [h.tokens for h in got[i]] == [h.tokens for h in hyps], i
        assert [h.score for h in got[i]] == pytest.approx([h.score for h in hyps], abs=1e-4)


def test_top_candidates_equal_a_top_k_over_every_extension():
    """The chunked ranking (chunk maxima first) returns what one top-k over all k x V extensions returns, also with
    empty beams (-inf scores), banned tokens, rows where only EOS may follow, and a vocabulary that is not a
    multiple of the chunk width."""
    from mtpipe.engine.search import top_candidates

    g = torch.Generator().manual_seed(3)
    for trial in range(60):
        vocab, n, k, m = 512 + 37 * trial, 1 + trial % 5, 1 + trial % 4, 1 + trial % 9
        logp = F.log_softmax(torch.randn(n * k, vocab, generator=g) * 3, dim=-1)
        logp[:, [PAD_ID, BOS_ID]] = float("-inf")
        scores = torch.randn(n, k, generator=g) - 5
        if trial % 3 == 0:
            scores[:, 1:] = float("-inf")  # a sentence that just joined: one live beam
        if trial % 4 == 0:
            logp[: k] = float("-inf")  # the first sentence at its length limit: only EOS
            logp[: k, EOS_ID] = -0.5
        want_v, want_i = (logp.view(n, k, vocab) + scores.unsqueeze(2)).view(n, k * vocab).topk(m, dim=1)
        got_v, got_i = top_candidates(logp, scores, m)
        assert torch.equal(got_v, want_v)
        finite = torch.isfinite(want_v)
        assert torch.equal(got_i[finite], want_i[finite])


def test_the_float32_cpu_variant_through_onednn_decodes_what_torch_s_own_products_decode(model):
    """decode's float32 CPU variant (mtpipe.engine.packed: oneDNN's products on packed weights) finds the same
    hypotheses as the same model on torch's own products, with scores equal up to float rounding."""
    from mtpipe.engine import packed
    from mtpipe.engine.variants import prepare

    srcs = sources(9, seed=5)
    cfg = DecodeConfig(beam=4, alpha=0.6, max_len_a=1.0, max_len_b=5)
    with packed.torch_products():
        assert not any(isinstance(m, packed.PackedLinear)
                       for m in prepare(copy.deepcopy(model), "fp32", torch.device("cpu")).model.modules())
        a = translate(model, srcs, cfg)
    if platform.onednn_linear() is not None:
        assert any(isinstance(m, packed.PackedLinear)
                   for m in prepare(copy.deepcopy(model), "fp32", torch.device("cpu")).model.modules())
    b = translate(model, srcs, cfg)
    assert [[h.tokens for h in r] for r in a] == [[h.tokens for h in r] for r in b]
    assert [h.score for r in a for h in r] == pytest.approx([h.score for r in b for h in r], abs=1e-4)
