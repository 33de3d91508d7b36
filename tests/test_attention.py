"""`mtpipe attention`: the drawn matrices are the model's own attention (equal to a teacher-forced forward pass of the
decoded output with forward hooks on its attention weights), each row a distribution, masked positions at zero; the
model keeps no state for it (hooks only, removed afterwards; the weights module not even called when unobserved);
the pictures, the page (local files only) and the matrices are written atomically; bad input fails in one line with
nothing written."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import synthetic_pairs, train_spm
from typer.testing import CliRunner

from mtpipe import artifacts, writing
from mtpipe.artifacts import EOS_ID
from mtpipe.stages.attention import (GRID_LABELS, HEAD_LABELS, KINDS, MAX_PIECES, AttentionMaps, attention_maps,
                              chosen_layers, head_figure, layer_figure, record_attention, tick_labels)
from mtpipe.cli import app
from mtpipe.config import MAX_BEAM, ModelConfig, to_dict
from mtpipe.engine.translate import translate_batches
from mtpipe.errors import MtpipeError
from mtpipe.model.transformer import Transformer
from mtpipe.engine.search import DecodeRules, LengthPenalty

TEXT = "Kalo mi tenra su ve dor."


def random_model(vocab: int, window: int = 0, seed: int = 0) -> Transformer:
    """A random tiny model (2 + 2 layers, 2 heads); 24 positions keep the (never-ending) greedy output short."""
    torch.manual_seed(seed)
    return Transformer(ModelConfig(preset="tiny", dropout=0.0, max_positions=24, attention_window=window),
                       vocab).eval()


def teacher_forced(model: Transformer, src_ids: list[int], out_ids: list[int]) -> dict[str, list[torch.Tensor]]:
    """Each layer's ``[h, Lq, Lk]`` weights of one full forward pass (model.encode / model.decode over the whole
    shifted output), taken by plain forward hooks on the attention modules' ``weights`` (not the stage's helper): the
    reference the step-by-step observation must equal."""
    src = torch.tensor([[*src_ids, EOS_ID]])  # [1, S]
    tgt_in = torch.tensor([[model.start_id, *out_ids[:-1]]])  # [1, T]
    attentions = {"encoder": [layer.self_attn for layer in model.encoder],
                  "decoder": [layer.self_attn for layer in model.decoder],
                  "cross": [layer.cross_attn for layer in model.decoder]}
    kept: dict[str, list[list[torch.Tensor]]] = {kind: [[] for _ in attentions[kind]] for kind in KINDS}
    handles = [m.weights.register_forward_hook(lambda _m, _in, w, calls=calls: calls.append(w[0].clone()))
               for kind in KINDS for m, calls in zip(attentions[kind], kept[kind])]
    with torch.no_grad():
        memory, src_mask = model.encode(src)
        model.decode(tgt_in, memory, src_mask)
    for handle in handles:
        handle.remove()
    assert all(len(calls) == 1 for kind in KINDS for calls in kept[kind])  # one full pass: one call per attention
    return {kind: [calls[0] for calls in kept[kind]] for kind in KINDS}  # [1, h, Lq, Lk] -> [h, Lq, Lk]


def check_distributions(weights: dict[str, list], window: int = 0) -> None:
    """Every row sums to 1 and is non-negative; in the decoder's self-attention a query never sees a later position
    (nor, with a window r, one more than r before it)."""
    for kind in KINDS:
        for w in weights[kind]:
            w = torch.as_tensor(np.asarray(w))
            assert (w >= 0).all()
            torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]), rtol=0, atol=1e-5)
    for w in weights["decoder"]:
        w = torch.as_tensor(np.asarray(w))
        steps = w.size(-1)
        i, j = torch.meshgrid(torch.arange(steps), torch.arange(steps), indexing="ij")
        hidden = (j > i) | ((i - j > window) if window else torch.zeros_like(i, dtype=torch.bool))
        assert (w[:, hidden] == 0).all()
        assert (w[:, ~hidden] > 0).all()  # softmax: every visible position gets some weight


@pytest.mark.parametrize("window", [0, 2])
def test_recorded_steps_equal_a_teacher_forced_forward_pass(window):
    model = random_model(60, window)
    src_ids = torch.randint(4, 60, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    best = translate_batches(model, [src_ids], DecodeRules(beam=1), max_tokens=64)[0][0]
    out_ids = [*best.tokens, EOS_ID]
    got = record_attention(model, src_ids, out_ids)
    want = teacher_forced(model, src_ids, out_ids)
    steps, length = len(out_ids), len(src_ids) + 1
    for kind, shape in (("encoder", (length, length)), ("decoder", (steps, steps)), ("cross", (steps, length))):
        assert len(got[kind]) == 2  # one matrix per layer
        for g, w in zip(got[kind], want[kind]):
            assert g.shape == (2, *shape)
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    check_distributions(got, window)


def module_state(model: Transformer) -> dict[str, dict[str, object]]:
    """Every module's own attributes: each value's identity, and a dict's or a list's items (hook registries
    included), so that a value set, replaced or filled in place shows."""
    def snapshot(value: object) -> object:
        if isinstance(value, dict):
            return [(k, id(v)) for k, v in value.items()]
        return [id(v) for v in value] if isinstance(value, list) else id(value)
    return {name: {k: snapshot(v) for k, v in vars(m).items()} for name, m in model.named_modules()}


def test_the_model_keeps_no_state_for_attention_maps():
    """model/ has no recording switch (no name ``record``/``recording`` in its source) and observing leaves nothing in
    the model: while observed, each attention's weights module has a hook; afterwards every module's attributes are
    what they were."""
    import ast

    import mtpipe.model
    from mtpipe.model.attention import AttentionWeights, MultiHeadAttention
    from mtpipe.stages.attention import observe_attention

    for path in sorted(Path(mtpipe.model.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {getattr(node, field) for node in ast.walk(tree) for field in ("id", "attr", "arg", "name")
                 if isinstance(getattr(node, field, None), str)}
        assert not names & {"record", "recording"}, path
    model = random_model(60)
    before = module_state(model)
    src, tgt = torch.tensor([[5, 9, 11, EOS_ID]]), torch.tensor([[model.start_id, 7, 8]])  # [1, S], [1, T]
    observed = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    assert len(observed) == 2 + 2 * 2  # each encoder layer's self-attention, each decoder layer's two
    assert all(isinstance(m.weights, AttentionWeights) for m in observed)
    with torch.no_grad(), observe_attention(model) as kept:
        assert all(m.observed() for m in observed)
        model(src, tgt)
    assert [len(calls) for kind in KINDS for calls in kept[kind]] == [1] * 6
    assert not any(m.observed() for m in observed)
    assert module_state(model) == before


def test_unobserved_attention_never_calls_the_weights_module_and_observing_changes_no_output():
    """Decoding steps with nobody observing never call :class:`AttentionWeights` (a global forward hook counts its
    calls); observing the same steps gives the same log-probabilities, bit for bit."""
    from mtpipe.engine.variants import prepare
    from mtpipe.model.attention import AttentionWeights
    from mtpipe.stages.attention import observe_attention

    calls: list[int] = []
    counter = torch.nn.modules.module.register_module_forward_hook(
        lambda m, _in, _out: calls.append(1) if isinstance(m, AttentionWeights) else None)
    model = random_model(60)
    src = torch.tensor([[5, 9, 11, 13, EOS_ID], [6, 7, 8, EOS_ID, 0]])  # [2, S], the second padded

    def decode(prepared) -> list[torch.Tensor]:
        state = prepared.start(*prepared.encode(src))
        out = []
        for token in (model.start_id, 12, 14):
            logp, state = prepared.step(torch.tensor([token, token]), state)  # [2, V]
            out.append(logp)
        return out

    try:
        with torch.inference_mode():
            prepared = prepare(model, "fp32", torch.device("cpu"))
            plain = decode(prepared)
            assert not calls
            with observe_attention(prepared.model) as kept:
                seen = decode(prepared)
    finally:
        counter.remove()
    assert len(calls) == 2 + 3 * 2 * 2  # the encoder's layers once, each decoder layer's two attentions per step
    assert [len(c) for c in kept["decoder"]] == [3, 3]
    for a, b in zip(plain, seen):
        assert torch.equal(a, b)


def test_layer_choice_defaults_to_the_last_and_refuses_out_of_range():
    assert chosen_layers(None, 6, 4) == {"encoder": 6, "decoder": 4, "cross": 4}
    assert chosen_layers(2, 6, 4) == {"encoder": 2, "decoder": 2, "cross": 2}
    for bad in (0, 5, -1):
        with pytest.raises(MtpipeError, match=f"--layer {bad}: out of range"):
            chosen_layers(bad, 6, 4)


# --------------------------------------------------------------------------------------------------------------------
# The command, end to end, on a random tiny checkpoint
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> dict:
    """A bpe artifact (a small SentencePiece model) and a random tiny checkpoint trained with it."""
    root = tmp_path_factory.mktemp("attention")
    sp = train_spm(root / "spm", [s for pair in synthetic_pairs(300, seed=5) for s in pair], vocab_size=150)
    tokens = root / "tokens"
    with writing.ArtifactWriter(tokens, "tokens") as w:
        w.write_table("test.parquet", pa.table({"id": [0], "src": [sp.encode("ka lo")], "tgt": [sp.encode("mi")]}))
        shutil.copy(root / "spm.model", w.path("spm.model"))
    model = random_model(sp.get_piece_size())
    checkpoint = root / "ckpt"
    writing.write_checkpoint(checkpoint, state_dict=model.state_dict(), meta=artifacts.CheckpointManifest(
        model_config=to_dict(model.cfg), step=7,
        vocab={"spm_sha256": artifacts.file_hash(root / "spm.model"), "size": sp.get_piece_size()}))
    return {"root": root, "tokens": tokens, "checkpoint": checkpoint, "model": model, "sp": sp}


def run(ckpt: dict, *args: str):
    return CliRunner().invoke(app, ["attention", "--checkpoint", str(ckpt["checkpoint"]), "--tokens",
                                    str(ckpt["tokens"]), *args])


@pytest.fixture(scope="module")
def drawn(ckpt) -> Path:
    out = ckpt["root"] / "drawn"
    r = run(ckpt, "--text", f"  {TEXT} ", "--layer", "1", "--out", str(out))
    assert r.exit_code == 0, r.output
    return out


def test_cli_matrices_are_the_models_attention_of_its_greedy_translation(ckpt, drawn):
    model, sp = ckpt["model"], ckpt["sp"]
    info = json.loads((drawn / "attention.json").read_text(encoding="utf-8"))
    src_ids = sp.encode(TEXT, out_type=int)
    greedy = translate_batches(model, [src_ids], DecodeRules(beam=1), max_tokens=64)[0][0].tokens
    # The axes: the source's pieces and the greedy output's (what decode --beam 1 translates), </s> last.
    assert info["text"] == TEXT and info["translation"] == sp.decode(greedy)
    assert info["source_pieces"] == [sp.id_to_piece(i) for i in [*src_ids, EOS_ID]]
    assert info["output_pieces"] == [sp.id_to_piece(i) for i in [*greedy, EOS_ID]]
    assert info["layer"] == {"encoder": 1, "decoder": 1, "cross": 1}
    want = teacher_forced(model, src_ids, [*greedy, EOS_ID])
    with np.load(drawn / "attention.npz") as npz:
        got = {kind: [npz[f"{kind}_layer{i}"] for i in (1, 2)] for kind in KINDS}
    for kind in KINDS:
        for g, w in zip(got[kind], want[kind]):
            torch.testing.assert_close(torch.from_numpy(g), w, rtol=1e-5, atol=1e-6)
    check_distributions(got)


def test_cli_writes_every_picture_and_a_page_of_local_files_only(drawn):
    m = artifacts.read_manifest(drawn, "attention")
    pngs = {p.name for p in drawn.glob("*.png")}
    heads = {f"{kind}-layer1-head{h}.png" for kind in KINDS for h in (1, 2)}  # --layer 1: each head of layer 1
    grids = {f"{kind}-layer{i}.png" for kind in KINDS for i in (1, 2)}  # every layer: all heads in one picture
    assert pngs == heads | grids
    for name in pngs:
        assert (drawn / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert artifacts.verify_file(drawn, name, m)  # listed in the manifest with its hash
    page = (drawn / "index.html").read_text(encoding="utf-8")
    assert "http" not in page.lower() and "<script" not in page.lower()
    refs = re.findall(r'(?:src|href)\s*=\s*"([^"]*)"', page)
    assert set(refs) == pngs  # every picture shown, nothing else referenced
    assert all((drawn / ref).is_file() and "/" not in ref for ref in refs)
    assert not [p for p in drawn.parent.iterdir() if ".tmp-" in p.name]  # no temporary left


def test_beam_search_output_is_drawn_and_recorded_the_same_way(ckpt):
    model, sp = ckpt["model"], ckpt["sp"]
    maps = attention_maps(model, sp, TEXT, beam=3)
    src_ids = sp.encode(TEXT, out_type=int)
    best = translate_batches(model, [src_ids], DecodeRules(beam=3), max_tokens=64)[0][0].tokens
    assert maps.outputs == [sp.id_to_piece(i) for i in [*best, EOS_ID]]
    want = teacher_forced(model, src_ids, [*best, EOS_ID])
    for kind in KINDS:
        for g, w in zip(maps.weights[kind], want[kind]):
            torch.testing.assert_close(torch.from_numpy(g), w, rtol=1e-5, atol=1e-6)


def test_beam_search_takes_the_checkpoints_recorded_length_penalty(ckpt, tmp_path):
    """With --beam > 1 the translation drawn is the one `mtpipe decode` gives by default: the checkpoint's recorded
    length penalty and alpha (here fairseq's |Y|^1.0), not always GNMT's."""
    root, model, sp = ckpt["root"], ckpt["model"], ckpt["sp"]
    checkpoint = tmp_path / "ckpt-fairseq"
    writing.write_checkpoint(checkpoint, state_dict=model.state_dict(), meta=artifacts.CheckpointManifest(
        model_config=to_dict(model.cfg), step=7, decode={"length_penalty": "fairseq", "alpha": 1.0},
        vocab={"spm_sha256": artifacts.file_hash(root / "spm.model"), "size": sp.get_piece_size()}))
    out = tmp_path / "drawn"
    r = CliRunner().invoke(app, ["attention", "--checkpoint", str(checkpoint), "--tokens", str(ckpt["tokens"]),
                                 "--text", TEXT, "--beam", "3", "--out", str(out)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "beam 3, fairseq alpha 1" in r.output
    src_ids = sp.encode(TEXT, out_type=int)
    want = translate_batches(model, [src_ids], DecodeRules(beam=3, penalty=LengthPenalty("fairseq", 1.0)),
                             max_tokens=64)[0][0].tokens
    assert json.loads((out / "attention.json").read_text(encoding="utf-8"))["translation"] == sp.decode(want)


@pytest.mark.parametrize("args, message", [
    (["--text", ""], "--text: empty"),
    (["--text", "   "], "--text: empty"),
    (["--text", TEXT, "--layer", "3"], "--layer 3: out of range; the model has 2 encoder and 2 decoder layers"),
    (["--text", TEXT, "--layer", "0"], "--layer 0: out of range"),
    (["--text", TEXT, "--checkpoint", "/nonexistent/ckpt"], "/nonexistent/ckpt: checkpoint not found"),
])
def test_bad_input_is_one_line_and_writes_nothing(ckpt, args, message):
    out = ckpt["root"] / "bad"
    r = run(ckpt, *args, "--out", str(out))
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.output
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(".bad.")]


def test_a_folder_mtpipe_did_not_write_is_not_replaced(ckpt):
    out = ckpt["root"] / "notes"
    out.mkdir()
    (out / "mine.txt").write_text("keep", encoding="utf-8")
    r = run(ckpt, "--text", TEXT, "--out", str(out))
    assert r.exit_code == 1 and "not an mtpipe artifact" in r.output
    assert [p.name for p in out.iterdir()] == ["mine.txt"]


# --------------------------------------------------------------------------------------------------------------------
# Long sentences: a bounded drawing, and a bound on the sentence
# --------------------------------------------------------------------------------------------------------------------


def synthetic_maps(source: int, output: int, layers: int = 2, heads: int = 4) -> AttentionMaps:
    """Maps of a ``source``-piece sentence and an ``output``-piece translation (</s> counted), random rows that sum
    to 1: what the pictures are drawn from, without a model."""
    rng = np.random.default_rng(0)

    def weights(rows: int, cols: int) -> np.ndarray:
        w = rng.random((heads, rows, cols)).astype(np.float32)
        return w / w.sum(-1, keepdims=True)

    src = [f"\u2581s{i}" for i in range(source)]
    out = [f"\u2581t{i}" for i in range(output)]
    return AttentionMaps("text", "translation", src, ["<s>", *out[:-1]], out,
                         {"encoder": [weights(source, source) for _ in range(layers)],
                          "decoder": [weights(output, output) for _ in range(layers)],
                          "cross": [weights(output, source) for _ in range(layers)]})


def shown_texts(fig) -> list:
    from matplotlib.text import Text

    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text()]


@pytest.mark.parametrize("n, most", [(5, 8), (8, 8), (9, 8), (256, 64), (257, 32), (1000, 32)])
def test_tick_labels_thin_a_long_axis_evenly_and_say_where_they_are(n, most):
    pieces = [f"p{i}" for i in range(n)]
    at, labels = tick_labels(pieces, most)
    assert 1 <= len(at) <= most and at[0] == 0 and len(labels) == len(at)
    steps = {b - a for a, b in zip(at, at[1:])}
    assert len(steps) <= 1  # evenly spaced
    if n <= most:
        assert at == list(range(n)) and labels == pieces  # short: every piece, as it is
    else:
        assert all(label == f"{i + 1} {pieces[i]}" for i, label in zip(at, labels))  # thinned: 1-based position


def test_a_long_sentence_is_drawn_with_a_bounded_number_of_artists():
    """What makes matplotlib slow is artists (chiefly the text of tick labels, measured at every layout pass), not
    pixels: a sentence at the bound draws each head as one image with no more labels than a short one's cap, and
    every figure stays within its size cap."""
    from matplotlib.image import AxesImage

    heads = 4
    for source in (12, MAX_PIECES):
        maps = synthetic_maps(source, source + 51, heads=heads)
        for kind in KINDS:
            fig = head_figure(maps, kind, 2, 1)
            assert len(fig.findobj(AxesImage)) == 1
            assert len(shown_texts(fig)) <= 2 * HEAD_LABELS + 20  # tick labels + title, axis names, colour bar
            assert max(fig.get_size_inches()) <= 17.2
            grid = layer_figure(maps, kind, 1)
            assert len(grid.findobj(AxesImage)) == heads
            # one row of 4 heads: the left panel's pieces and the bottom of each column's
            assert len(shown_texts(grid)) <= (1 + heads) * GRID_LABELS + heads + 20
            assert max(grid.get_size_inches()) <= 7.0 * 4 + 1.0
    import io

    maps = synthetic_maps(MAX_PIECES, MAX_PIECES + 51, layers=1, heads=2)
    for fig in (head_figure(maps, "decoder", 1, 1), layer_figure(maps, "cross", 1)):
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=50)
        assert buffer.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def long_ckpt(ckpt) -> Path:
    """The random tiny model with room for more than MAX_PIECES positions, so that attention's own bound, not the
    model's, is the one a long sentence meets."""
    root, sp = ckpt["root"], ckpt["sp"]
    torch.manual_seed(0)
    model = Transformer(ModelConfig(preset="tiny", dropout=0.0, max_positions=2 * MAX_PIECES), sp.get_piece_size())
    checkpoint = root / "ckpt-long"
    writing.write_checkpoint(checkpoint, state_dict=model.state_dict(), meta=artifacts.CheckpointManifest(
        model_config=to_dict(model.cfg), step=7,
        vocab={"spm_sha256": artifacts.file_hash(root / "spm.model"), "size": sp.get_piece_size()}))
    return checkpoint


def test_a_sentence_over_the_bound_is_refused_in_one_line_before_any_drawing(ckpt, long_ckpt):
    text = " ".join([TEXT] * (MAX_PIECES // len(ckpt["sp"].encode(TEXT)) + 2))
    pieces = len(ckpt["sp"].encode(text))
    assert MAX_PIECES < pieces < 2 * MAX_PIECES - 1  # within the model's positions, over attention's bound
    out = ckpt["root"] / "too-long"
    r = CliRunner().invoke(app, ["attention", "--checkpoint", str(long_ckpt), "--tokens", str(ckpt["tokens"]),
                                 "--text", text, "--out", str(out)])
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert len(lines) == 1, r.output
    assert lines[0] == (f"error: --text: {pieces} pieces, more than the {MAX_PIECES} that attention draws (a longer "
                        "sentence's heatmap cells are too small to read); give a shorter sentence")
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(".too-long")]


@pytest.mark.parametrize("beam", ["0", str(MAX_BEAM + 1), "100000"])
def test_beam_out_of_range_is_one_line_naming_the_limit(ckpt, beam):
    out = ckpt["root"] / "bad-beam"
    r = run(ckpt, "--text", TEXT, "--beam", beam, "--out", str(out))
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert lines == [f"error: --beam {beam}: must be between 1 (greedy search) and {MAX_BEAM}"], r.output
    assert not out.exists()
