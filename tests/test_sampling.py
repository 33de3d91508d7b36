"""Sampling (decode.sampling_topk, sampling_topp, temperature, seed): draws follow the truncated, tempered
distribution; a sample is reproducible for a seed and does not depend on the sentences that share its batch; top-k 1
and a tiny top-p are greedy search; the command reaches it, and invalid settings are refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_ensemble import decode, rows, write_model, write_tokens

from mtpipe import artifacts
from mtpipe.config import DecodeConfig, ModelConfig, ServeConfig, check_sections
from mtpipe.engine.sampling import Sampler, sentence_key
from mtpipe.engine.search import DecodeRules
from mtpipe.engine.translate import MtpipeEngine
from mtpipe.errors import MtpipeError
from mtpipe.model.transformer import Transformer

VOCAB = 40


@pytest.fixture(scope="module")
def engine() -> MtpipeEngine:
    """A random tiny model: unscaled, so its next-token distributions are flat enough for samples to differ."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(preset="tiny", dropout=0.0, max_positions=64), VOCAB).eval()
    return MtpipeEngine.open(model, DecodeConfig(device="cpu", threads=1, max_tokens=60))


def sources(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(1, 12, (n,), generator=g)]


def run(engine, srcs, **rules) -> list[list[tuple[list[int], float]]]:
    got = engine.translate(srcs, DecodeRules(max_len_a=0, max_len_b=12, **{"beam": 1, **rules}))
    return [[(h.tokens, h.score) for h in r] for r in got]


def test_draws_follow_the_tempered_truncated_distribution():
    """Many sentences' draws from one row of log-probabilities: their frequencies are that row's probabilities
    after temperature, top-k and top-p, renormalised (the Gumbel-max trick over the hashed uniforms)."""
    torch.manual_seed(1)
    logp = F.log_softmax(torch.randn(1, 12) * 1.5, dim=-1)
    n = 20000
    keys = torch.tensor([sentence_key([i]) for i in range(n)])
    steps = torch.zeros(n, dtype=torch.long)

    def frequencies(sampler: Sampler) -> torch.Tensor:
        _, idx = sampler.pick(logp.expand(n, 12), torch.zeros(n, 1), keys, steps, 1)
        return torch.bincount(idx.view(-1), minlength=12).float() / n

    def expected(temperature: float, topk: int = 12, topp: float = 1.0) -> torch.Tensor:
        p = F.softmax(logp[0] / temperature, dim=-1)
        order = p.argsort(descending=True)
        keep = torch.zeros(12, dtype=torch.bool)
        keep[order[:topk]] = True
        p = torch.where(keep, p, torch.zeros_like(p))
        p = p / p.sum()
        before = p[order].cumsum(0) - p[order]  # the mass of the more likely tokens
        keep[order[before >= topp]] = False
        p = torch.where(keep, p, torch.zeros_like(p))
        return p / p.sum()

    cases = [(Sampler(temperature=1.0), expected(1.0)), (Sampler(temperature=0.5), expected(0.5)),
             (Sampler(temperature=2.0), expected(2.0)), (Sampler(topk=3), expected(1.0, topk=3)),
             (Sampler(topp=0.6), expected(1.0, topp=0.6)), (Sampler(topk=5, topp=0.8, temperature=1.5),
                                                              expected(1.5, topk=5, topp=0.8))]
    for sampler, want in cases:
        got = frequencies(sampler)
        assert (got - want).abs().max() < 0.015, (sampler, got, want)
        assert got[want == 0].sum() == 0  # a cut token is never drawn
    # temperature changes the distribution: sharper below 1, flatter above
    assert (expected(0.5) - expected(2.0)).abs().max() > 0.1
    assert frequencies(Sampler(temperature=0.5)).max() > frequencies(Sampler(temperature=2.0)).max() + 0.1


def test_samples_are_reproducible_for_a_seed_and_differ_across_seeds(engine):
    srcs = sources(16, seed=2)
    first = run(engine, srcs, sampling_topk=-1, seed=5)
    assert run(engine, srcs, sampling_topk=-1, seed=5) == first
    assert run(engine, srcs, sampling_topk=-1, seed=6) != first
    assert first != run(engine, srcs)  # not the search's output


@pytest.mark.parametrize("beam", [1, 3])
def test_a_sentences_sample_does_not_depend_on_its_batch(engine, beam):
    """Alone, in a batch of others, in another order, in batches of another size: the same sample."""
    srcs = sources(14, seed=3)
    rules = {"sampling_topk": 8, "sampling_topp": 0.9, "temperature": 1.3, "seed": 11, "beam": beam, "nbest": beam}
    together = run(engine, srcs, **rules)

    def same(a, b) -> bool:  # the same samples; scores up to the float rounding of another batch's matmuls
        return all([t for t, _ in x] == [t for t, _ in y] and [s for _, s in x] == pytest.approx([s for _, s in y],
                                                                                                abs=1e-4)
                   for x, y in zip(a, b, strict=True))

    assert same([run(engine, [s], **rules)[0] for s in srcs[:5]], together[:5])
    assert same(run(engine, srcs[::-1], **rules)[::-1], together)
    small = MtpipeEngine(engine.prepared, engine.device, engine.precision, max_tokens=12, threads=1)
    assert same(run(small, srcs, **rules), together)
    if beam > 1:  # several samples per sentence, not copies of one
        assert len({tuple(t) for r in together for t, _ in r}) > len(srcs)


def test_top_k_1_and_a_tiny_top_p_are_greedy_search(engine):
    srcs = sources(12, seed=4)
    greedy = run(engine, srcs)
    assert run(engine, srcs, sampling_topk=1, seed=3) == greedy
    assert run(engine, srcs, sampling_topk=1, temperature=3.0) == greedy
    assert run(engine, srcs, sampling_topk=-1, sampling_topp=1e-6) == greedy


def test_invalid_sampling_settings_are_refused():
    for kw, message in ((dict(sampling_topk=-2), "decode.sampling_topk = -2 must be >= -1"),
                        (dict(sampling_topk=5, sampling_topp=0.0), "decode.sampling_topp = 0.0 must be > 0"),
                        (dict(sampling_topk=5, sampling_topp=1.5), "decode.sampling_topp = 1.5 must be > 0 and <= 1"),
                        (dict(sampling_topk=5, temperature=0.0), "decode.temperature = 0.0 must be > 0"),
                        (dict(sampling_topk=5, seed=-1), "decode.seed = -1 must be >= 0"),
                        (dict(temperature=0.7), "decode.temperature = 0.7 applies to sampling"),
                        (dict(sampling_topp=0.9), "decode.sampling_topp = 0.9 applies to sampling"),
                        (dict(sampling_topk=5, engine="ctranslate2"), "sampling is engine mtpipe's")):
        with pytest.raises(MtpipeError, match=message.replace(".", r"\.")):
            DecodeConfig(**kw)
    for kw in (dict(sampling_topk=-3), dict(sampling_topp=2.0), dict(temperature=float("nan"))):
        with pytest.raises(MtpipeError):
            DecodeRules(**kw)  # rules built in code are checked too
    with pytest.raises(MtpipeError, match="mtpipe serve translates by search"):
        check_sections(serve=ServeConfig(), decode=DecodeConfig(sampling_topk=5))


def test_cli_samples_reproducibly(tmp_path):
    tokens, sp = write_tokens(tmp_path, "spm", 120)  # test_ensemble's small project: a bpe artifact, a checkpoint
    ck = write_model(tmp_path / "ck", tmp_path / "spm.model", sp.get_piece_size(), 0)
    (tmp_path / "params.yaml").write_text("", encoding="utf-8")
    project = {"root": tmp_path, "tokens": tokens}
    flags = ("--beam", "1", "--sampling-topk", "-1", "--temperature", "1.5", "--seed", "4")
    for out in ("s1", "s2"):
        r = decode(project, out, ck, extra=flags)
        assert r.exit_code == 0, r.output
    assert rows(project, "s1") == rows(project, "s2")
    assert artifacts.read_manifest(tmp_path / "s1", "hypotheses").extra["decode"]["sampling_topk"] == -1
    assert decode(project, "greedy", ck, extra=("--beam", "1")).exit_code == 0
    assert rows(project, "greedy") != rows(project, "s1")
    r = decode(project, "bad", ck, extra=("--temperature", "0.5"))
    assert r.exit_code == 1 and r.output.count("\n") == 1 and "applies to sampling" in r.output
    assert not (tmp_path / "bad").exists()
