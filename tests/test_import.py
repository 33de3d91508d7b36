"""``mtpipe import --format fairseq``: a fairseq-format checkpoint built here (no fairseq install) decodes to the same
tokens as a reference forward written from fairseq 0.12's documented model (plain torch on its state dict), in the
layouts the importer must map (post-norm with all embeddings shared and sinusoids; pre-norm with three matrices,
learned positions and a SentencePiece model with SentencePiece's default special ids); the result averages and
exports; what cannot be mapped is refused in one line with nothing written."""

from __future__ import annotations

import argparse
import math
import random
import shutil
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
import torch.nn.functional as F
from conftest import synthetic_pairs
from testkit.decoding import translate
from typer.testing import CliRunner

from mtpipe import artifacts
from mtpipe.cli import app
from mtpipe.config import DecodeConfig
from mtpipe.engine.loading import load_model_and_vocab

BOS, PAD, EOS, UNK = 0, 1, 2, 3  # fairseq.data.Dictionary
D, FF, HEADS, LAYERS, MAXPOS = 16, 32, 2, 2, 64


# --------------------------------------------------------------------------------------------------------------------
# A fairseq checkpoint, dictionary and SentencePiece model
# --------------------------------------------------------------------------------------------------------------------


def make_spm(root: Path, default_ids: bool) -> Path:
    lines = [s for pair in synthetic_pairs(300, seed=3) for s in pair]
    text = root / "spm.txt"
    text.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    ids = {} if default_ids else dict(pad_id=0, unk_id=1, bos_id=2, eos_id=3)  # default: unk 0, bos 1, eos 2, no pad
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(root / "spm"), vocab_size=120, model_type="bpe",
                                   hard_vocab_limit=False, minloglevel=2, **ids)
    return root / "spm.model"


def write_dict(root: Path, sp: spm.SentencePieceProcessor, seed: int) -> list[str]:
    """dict.en.txt = dict.de.txt: most normal pieces in a shuffled order, then fairseq's padding symbols to a multiple
    of 8; returns the symbols by fairseq id."""
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())
              if not (sp.is_control(i) or sp.is_unknown(i))]
    rng = random.Random(seed)
    rng.shuffle(pieces)
    kept = pieces[: len(pieces) - 5]  # five pieces fairseq never saw: they must take no probability mass
    if (4 + len(kept)) % 8 == 0:
        kept = kept[:-1]  # so that fairseq pads the dictionary with at least one madeupword
    symbols = ["<s>", "<pad>", "</s>", "<unk>", *kept]
    i = 0
    while len(symbols) % 8:
        symbols.append(f"madeupword{i:04d}")
        i += 1
    text = "".join(f"{s} {0 if s.startswith('madeupword') else 100 - min(j, 99)}\n"
                   for j, s in enumerate(symbols[4:]))
    (root / "fs-bin").mkdir(exist_ok=True)
    for lang in ("en", "de"):
        (root / "fs-bin" / f"dict.{lang}.txt").write_text(text, encoding="utf-8")
    return symbols


def fairseq_state(vocab: int, pre: bool, shared: bool, learned: bool, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    sd: dict[str, torch.Tensor] = {}
    emb = rnd(vocab, D, scale=D**-0.5 * 3)
    emb[PAD] = 0
    sd["encoder.embed_tokens.weight"] = emb
    sd["decoder.embed_tokens.weight"] = emb if shared else rnd(vocab, D, scale=D**-0.5 * 3)
    sd["decoder.output_projection.weight"] = sd["decoder.embed_tokens.weight"] if shared else rnd(vocab, D)
    for stack in ("encoder", "decoder"):
        sd[f"{stack}.version"] = torch.tensor([3.0])
        if learned:
            sd[f"{stack}.embed_positions.weight"] = rnd(MAXPOS + PAD + 1, D)
        else:
            sd[f"{stack}.embed_positions._float_tensor"] = torch.tensor([1.0])
        if pre:
            sd[f"{stack}.layer_norm.weight"], sd[f"{stack}.layer_norm.bias"] = 1 + rnd(D, scale=0.1), rnd(D, scale=0.1)
        attns = ["self_attn"] if stack == "encoder" else ["self_attn", "encoder_attn"]
        for i in range(LAYERS):
            p = f"{stack}.layers.{i}"
            for a in attns:
                for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                    sd[f"{p}.{a}.{proj}.weight"], sd[f"{p}.{a}.{proj}.bias"] = rnd(D, D), rnd(D, scale=0.1)
                sd[f"{p}.{a}_layer_norm.weight"] = 1 + rnd(D, scale=0.1)
                sd[f"{p}.{a}_layer_norm.bias"] = rnd(D, scale=0.1)
            sd[f"{p}.fc1.weight"], sd[f"{p}.fc1.bias"] = rnd(FF, D), rnd(FF, scale=0.1)
            sd[f"{p}.fc2.weight"], sd[f"{p}.fc2.bias"] = rnd(D, FF), rnd(D, scale=0.1)
            sd[f"{p}.final_layer_norm.weight"] = 1 + rnd(D, scale=0.1)
            sd[f"{p}.final_layer_norm.bias"] = rnd(D, scale=0.1)
            if stack == "encoder":  # fairseq 0.12.2's copies for its fused inference path
                for name, shape in (("in_proj_weight", (3 * D, D)), ("in_proj_bias", (3 * D,)),
                                    ("out_proj_weight", (D, D)), ("out_proj_bias", (D,)), ("fc1_weight", (FF, D)),
                                    ("fc1_bias", (FF,)), ("fc2_weight", (D, FF)), ("fc2_bias", (D,))):
                    sd[f"{p}.{name}"] = torch.zeros(shape)
    return sd


def fairseq_options(pre: bool, shared: bool, learned: bool, **over) -> argparse.Namespace:
    opts = dict(arch="transformer", encoder_embed_dim=D, decoder_embed_dim=D, encoder_ffn_embed_dim=FF,
                decoder_ffn_embed_dim=FF, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
                decoder_attention_heads=HEADS, encoder_normalize_before=pre, decoder_normalize_before=pre,
                encoder_learned_pos=learned, decoder_learned_pos=learned, share_all_embeddings=shared,
                share_decoder_input_output_embed=shared, max_source_positions=MAXPOS, max_target_positions=MAXPOS,
                activation_fn="relu", dropout=0.1, attention_dropout=0.0, activation_dropout=0.0,
                no_scale_embedding=False, layernorm_embedding=False)
    opts.update(over)
    return argparse.Namespace(**opts)


def save_checkpoint(path: Path, state: dict, opts: argparse.Namespace, extra: object = None) -> Path:
    ck = {"args": None, "cfg": {"model": opts, "task": {"source_lang": "en", "target_lang": "de"}}, "model": state,
          "optimizer_history": [{"num_updates": 10}], "extra_state": {"train_iterator": {"epoch": 1}}}
    if extra is not None:
        ck["extra_state"]["meter"] = extra
    torch.save(ck, path)
    return path


# --------------------------------------------------------------------------------------------------------------------
# fairseq's model, written from its documentation: the reference
# --------------------------------------------------------------------------------------------------------------------


def sinusoids(rows: int) -> torch.Tensor:
    half = D // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float) * -(math.log(10000) / (half - 1)))
    table = torch.arange(rows, dtype=torch.float)[:, None] * freq[None]
    table = torch.cat([torch.sin(table), torch.cos(table)], dim=1)
    table[PAD] = 0
    return table


class Reference:
    """fairseq's transformer on one sentence at a time: positions from padding_idx + 1, q scaled by head_dim^-0.5
    after its projection, post- or pre-norm, ReLU, decoding from </s>, log-softmax over every dictionary row."""

    def __init__(self, sd: dict[str, torch.Tensor], pre: bool, learned: bool):
        self.sd, self.pre, self.learned = sd, pre, learned

    def embed(self, stack: str, tokens: list[int]) -> torch.Tensor:
        pos = torch.arange(len(tokens)) + PAD + 1
        table = self.sd[f"{stack}.embed_positions.weight"] if self.learned else sinusoids(MAXPOS + PAD + 1)
        return math.sqrt(D) * self.sd[f"{stack}.embed_tokens.weight"][tokens] + table[pos]

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (D,), self.sd[f"{name}.weight"], self.sd[f"{name}.bias"], 1e-5)

    def lin(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.sd[f"{name}.weight"], self.sd[f"{name}.bias"])

    def attention(self, name: str, x: torch.Tensor, mem: torch.Tensor, causal: bool) -> torch.Tensor:
        hd = D // HEADS
        q = self.lin(f"{name}.q_proj", x) * hd**-0.5
        k, v = self.lin(f"{name}.k_proj", mem), self.lin(f"{name}.v_proj", mem)
        q, k, v = (t.view(t.size(0), HEADS, hd).transpose(0, 1) for t in (q, k, v))  # [L, D] -> [h, L, hd]
        scores = q @ k.transpose(1, 2)  # [h, Lq, Lk]
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores[0], dtype=torch.bool).triu(1), float("-inf"))
        o = torch.softmax(scores, -1) @ v  # [h, Lq, hd]
        return self.lin(f"{name}.out_proj", o.transpose(0, 1).reshape(x.size(0), D))  # [Lq, h, hd] -> [Lq, D]

    def sub(self, x: torch.Tensor, norm: str, f) -> torch.Tensor:
        if self.pre:
            return x + f(self.norm(norm, x))
        return self.norm(norm, x + f(x))

    def encode(self, src: list[int]) -> torch.Tensor:
        x = self.embed("encoder", src)
        for i in range(LAYERS):
            p = f"encoder.layers.{i}"
            x = self.sub(x, f"{p}.self_attn_layer_norm", lambda y: self.attention(f"{p}.self_attn", y, y, False))
            x = self.sub(x, f"{p}.final_layer_norm",
                         lambda y: self.lin(f"{p}.fc2", torch.relu(self.lin(f"{p}.fc1", y))))
        return self.norm("encoder.layer_norm", x) if self.pre else x

    def log_probs(self, mem: torch.Tensor, prefix: list[int]) -> torch.Tensor:
        """Log-probabilities ``[len(prefix), V]`` of the next token after each position of ``prefix``."""
        x = self.embed("decoder", prefix)
        for i in range(LAYERS):
            p = f"decoder.layers.{i}"
            x = self.sub(x, f"{p}.self_attn_layer_norm", lambda y: self.attention(f"{p}.self_attn", y, y, True))
            x = self.sub(x, f"{p}.encoder_attn_layer_norm",
                         lambda y: self.attention(f"{p}.encoder_attn", y, mem, False))
            x = self.sub(x, f"{p}.final_layer_norm",
                         lambda y: self.lin(f"{p}.fc2", torch.relu(self.lin(f"{p}.fc1", y))))
        if self.pre:
            x = self.norm("decoder.layer_norm", x)
        return torch.log_softmax(x @ self.sd["decoder.output_projection.weight"].T, -1)

    def greedy(self, src: list[int], max_len: int) -> list[int]:
        with torch.no_grad():
            mem, out = self.encode(src + [EOS]), []
            for _ in range(max_len):
                lp = self.log_probs(mem, [EOS] + out)[-1]
                lp[PAD] = lp[BOS] = float("-inf")  # never generated (mtpipe bans both; fairseq bans pad)
                t = int(lp.argmax())
                if t == EOS:
                    break
                out.append(t)
        return out


# --------------------------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------------------------


def run_import(ck: Path, dict_dir: Path, spm_model: Path, out: Path, tokens_out: Path, *extra: str):
    return CliRunner().invoke(app, ["import", "--format", "fairseq", "--checkpoint", str(ck), "--dict", str(dict_dir),
                                    "--spm-model", str(spm_model), "--out", str(out), "--tokens-out",
                                    str(tokens_out), *extra])


LAYOUTS = {
    "post_shared_sinusoids": dict(pre=False, shared=True, learned=False, default_ids=False),
    "pre_separate_learned_default_spm": dict(pre=True, shared=False, learned=True, default_ids=True),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def imported(request, tmp_path_factory):
    layout = LAYOUTS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    spm_model = make_spm(root, layout["default_ids"])
    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    symbols = write_dict(root, sp, seed=5)
    state = fairseq_state(len(symbols), layout["pre"], layout["shared"], layout["learned"], seed=7)
    ck = save_checkpoint(root / "checkpoint.pt", state, fairseq_options(layout["pre"], layout["shared"],
                                                                        layout["learned"]))
    r = run_import(ck, root / "fs-bin", spm_model, root / "ck", root / "bpe")
    assert r.exit_code == 0, r.output
    return dict(root=root, sp=sp, symbols=symbols, state=state, layout=layout, spm_model=spm_model)


def sources(sp: spm.SentencePieceProcessor) -> list[str]:
    return [s for s, _ in synthetic_pairs(12, seed=11)]


def test_imported_model_decodes_what_fairseq_decodes(imported):
    """Greedy outputs (as piece strings) equal the reference's on every sentence, and the teacher-forced
    log-probabilities of every next piece agree to float rounding."""
    root, sp, symbols, lay = imported["root"], imported["sp"], imported["symbols"], imported["layout"]
    index = {s: i for i, s in enumerate(symbols)}
    ref = Reference(imported["state"], lay["pre"], lay["learned"])
    mv = load_model_and_vocab(root / "ck", root / "bpe")
    assert mv.model.cfg.decoder_start == "eos"
    assert mv.model.cfg.share_embeddings == ("all" if lay["shared"] else "none")
    msp = mv.sp
    texts = sources(sp)
    mt_src = [msp.encode(t) for t in texts]
    fs_src = [[index.get(p, UNK) for p in sp.encode(t, out_type=str)] for t in texts]
    # same segmentation as the original SentencePiece model, whatever ids the import gave the pieces
    assert [[msp.id_to_piece(i) for i in s] for s in mt_src] == [sp.encode(t, out_type=str) for t in texts]
    hyps = translate(mv.model, mt_src, DecodeConfig(beam=1, max_len_a=1.0, max_len_b=10))
    outputs = 0
    for s_mt, s_fs, h in zip(mt_src, fs_src, hyps):
        want = [symbols[t] for t in ref.greedy(s_fs, len(s_mt) + 10)]
        got = [msp.id_to_piece(t) for t in h[0].tokens]
        assert got == want
        outputs += len(got)
        # teacher-forced on the reference output: every step's distribution, mapped by piece
        with torch.no_grad():
            lp_ref = ref.log_probs(ref.encode(s_fs + [EOS]), [EOS] + [index[p] for p in want])
            tgt_in = torch.tensor([[mv.model.start_id] + [msp.piece_to_id(p) for p in want]])
            lp_mt = torch.log_softmax(mv.model(torch.tensor([s_mt + [3]]), tgt_in)[0], -1)
        shared = [i for i in range(msp.get_piece_size()) if msp.id_to_piece(i) in index and i not in (0, 2)]
        cols_ref = [index[msp.id_to_piece(i)] for i in shared]
        torch.testing.assert_close(lp_mt[:, shared], lp_ref[:, cols_ref], rtol=0, atol=1e-4)
        absent = [i for i in range(msp.get_piece_size()) if msp.id_to_piece(i) not in index]
        assert lp_mt[:, absent].max() < -1e8  # pieces fairseq never had take no probability
    assert outputs > 0  # the model does not stop at once


def test_rewritten_spm_has_mtpipes_special_ids_and_the_padding_symbols(imported):
    msp = spm.SentencePieceProcessor(model_file=str(imported["root"] / "bpe" / "spm.model"))
    assert (msp.pad_id(), msp.unk_id(), msp.bos_id(), msp.eos_id()) == (0, 1, 2, 3)
    pad_symbols = [s for s in imported["symbols"] if s.startswith("madeupword")]
    assert pad_symbols and all(msp.piece_to_id(s) != msp.unk_id() and msp.is_unused(msp.piece_to_id(s))
                               for s in pad_symbols)
    text = " ".join(sources(imported["sp"]))
    assert msp.encode(text, out_type=str) == imported["sp"].encode(text, out_type=str)


def test_imported_checkpoint_carries_the_rewritten_spm(imported):
    """The checkpoint carries the bpe artifact's (rewritten) SentencePiece model, so it loads without --tokens."""
    root = imported["root"]
    m = artifacts.read_manifest(root / "ck", "checkpoint")
    assert artifacts.checkpoint_spm(root / "ck", m) == root / "ck" / "spm.model"
    assert (root / "ck" / "spm.model").read_bytes() == (root / "bpe" / "spm.model").read_bytes()
    assert (root / "ck" / "spm.vocab").read_bytes() == (root / "bpe" / "spm.vocab").read_bytes()
    mv = load_model_and_vocab(root / "ck")
    assert mv.tokens is None and mv.spm_path == root / "ck" / "spm.model"


def test_import_without_tokens_out_writes_the_checkpoint_alone(imported, tmp_path):
    """--tokens-out is optional: the checkpoint alone carries the same SentencePiece files and weights, and nothing
    else is written next to it."""
    root = imported["root"]
    r = CliRunner().invoke(app, ["import", "--format", "fairseq", "--checkpoint", str(root / "checkpoint.pt"),
                                 "--dict", str(root / "fs-bin"), "--spm-model", str(imported["spm_model"]),
                                 "--out", str(tmp_path / "ck")])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    for name in ("spm.model", "spm.vocab"):
        assert (tmp_path / "ck" / name).read_bytes() == (root / "ck" / name).read_bytes()
    a, b = load_model_and_vocab(root / "ck"), load_model_and_vocab(tmp_path / "ck")
    for (k, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=k)


def test_imported_checkpoint_averages_and_exports(imported, tmp_path):
    root = imported["root"]
    shutil.copytree(root / "ck", tmp_path / "ck2")  # a second import of the same weights
    r = CliRunner().invoke(app, ["average", "--checkpoint", str(root / "ck"), "--checkpoint", str(tmp_path / "ck2"),
                                 "--out", str(tmp_path / "avg")])
    assert r.exit_code == 0, r.output
    a, b = load_model_and_vocab(root / "ck", root / "bpe"), load_model_and_vocab(tmp_path / "avg", root / "bpe")
    for (k, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        torch.testing.assert_close(x, y, msg=k)  # the mean of two equal checkpoints is the checkpoint
    pytest.importorskip("ctranslate2")
    from mtpipe.engine.ct2 import load_ct2

    r = CliRunner().invoke(app, ["export", "--checkpoint", str(root / "ck"), "--tokens", str(root / "bpe"),
                                 "--out", str(tmp_path / "ct2")])
    assert r.exit_code == 0, r.output
    ct2 = load_ct2(tmp_path / "ct2", threads=1)
    texts = sources(imported["sp"])[:4]
    pieces = [a.sp.encode(t, out_type=str) for t in texts]
    res = ct2.translator.translate_batch(pieces, beam_size=1, max_decoding_length=12,
                                         suppress_sequences=[["<pad>"], ["<s>"]])
    hyps = translate(a.model, [a.sp.encode(t) for t in texts], DecodeConfig(beam=1, max_len_a=0.0, max_len_b=11))
    for r_ct2, h in zip(res, hyps):
        mt = [a.sp.id_to_piece(t) for t in h[0].tokens]
        got = r_ct2.hypotheses[0]
        assert got[: len(mt)] == mt  # CTranslate2 may stop at its own limit, never differ before


# -- refusals ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("refusals")
    spm_model = make_spm(root, False)
    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    symbols = write_dict(root, sp, seed=2)
    return dict(root=root, spm_model=spm_model, symbols=symbols)


def _refused(base, tmp_path, state=None, opts=None, dict_text=None, extra=None, args=()):
    root = base["root"]
    dict_dir = tmp_path / "dicts"
    dict_dir.mkdir()
    text = dict_text if dict_text is not None else (root / "fs-bin" / "dict.en.txt").read_text(encoding="utf-8")
    for lang in ("en", "de"):
        (dict_dir / f"dict.{lang}.txt").write_text(text, encoding="utf-8")
    state = state or fairseq_state(len(base["symbols"]), False, True, False, seed=1)
    ck = save_checkpoint(tmp_path / "checkpoint.pt", state, opts or fairseq_options(False, True, False), extra)
    out, tok = tmp_path / "out", tmp_path / "bpe"
    r = run_import(ck, dict_dir, base["spm_model"], out, tok, *args) if not args else CliRunner().invoke(app, [
        "import", "--checkpoint", str(ck), "--dict", str(dict_dir), "--spm-model", str(base["spm_model"]), *args])
    assert r.exit_code == 1, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert not out.exists() and not tok.exists()
    return lines[0]


def test_a_dictionary_entry_sentencepiece_cannot_produce_is_refused(base, tmp_path):
    text = (base["root"] / "fs-bin" / "dict.en.txt").read_text(encoding="utf-8")
    text = text.replace("madeupword0000 0", "Zürich 3", 1)
    assert "Zürich" in text
    msg = _refused(base, tmp_path, dict_text=text)
    assert "dict.de.txt" in msg and "'Zürich'" in msg and "not pieces of" in msg


def test_a_dictionary_that_does_not_fit_the_embeddings_is_refused(base, tmp_path):
    text = (base["root"] / "fs-bin" / "dict.en.txt").read_text(encoding="utf-8") + "extra 1\n"
    msg = _refused(base, tmp_path, dict_text=text)
    assert "dict.en.txt" in msg and "not the dictionary it was trained with" in msg


@pytest.mark.parametrize("over, pattern", [
    (dict(layernorm_embedding=True), "layernorm_embedding"),
    (dict(decoder_embed_dim=2 * D), "decoder_embed_dim"),
    (dict(activation_fn="gelu"), "activation_fn=gelu"),
    (dict(encoder_normalize_before=True), "decoder_normalize_before=False"),
])
def test_options_mtpipe_lacks_are_refused(base, tmp_path, over, pattern):
    msg = _refused(base, tmp_path, opts=fairseq_options(False, True, False, **over))
    assert "checkpoint.pt" in msg and pattern in msg


class Meter:  # a pickled class: torch.load(weights_only=True) must not run it
    pass


def test_a_checkpoint_with_pickled_objects_is_refused(base, tmp_path):
    msg = _refused(base, tmp_path, extra=Meter())
    assert "checkpoint.pt" in msg and "Meter" in msg


def test_an_extra_parameter_is_refused_by_name(base, tmp_path):
    state = fairseq_state(len(base["symbols"]), False, True, False, seed=1)
    state["decoder.layers.0.w_resid"] = torch.ones(D)  # NormFormer's residual scale
    msg = _refused(base, tmp_path, state=state)
    assert "decoder.layers.0.w_resid" in msg


def test_outputs_may_not_overlap_and_every_input_is_required(base, tmp_path):
    root = base["root"]
    msg = _refused(base, tmp_path, args=("--out", str(tmp_path / "same"), "--tokens-out", str(tmp_path / "same")))
    assert "same" in msg
    r = CliRunner().invoke(app, ["import", "--checkpoint", str(root / "none.pt"), "--spm-model",
                                 str(base["spm_model"]), "--out", str(tmp_path / "o"), "--tokens-out",
                                 str(tmp_path / "t")])
    assert r.exit_code == 1 and "--dict: required" in r.output
