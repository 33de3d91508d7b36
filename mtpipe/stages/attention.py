"""``mtpipe attention``: the attention weights of one sentence as heatmaps, as the paper's Figures 3-5 show them.

The paper (section 3.2.3, appendix "Attention Visualizations") looks at what the heads of one layer attend to. Here,
for one input sentence:

* the sentence is encoded as ``decode`` encodes raw text (NFC, stripped, the checkpoint's SentencePiece model) and
  translated by the same search (greedy by default, ``--beam`` for beam search);
* the translation is then decoded once more, step by step (:meth:`mtpipe.engine.variants.Prepared.start` /
  :meth:`~mtpipe.engine.variants.Prepared.step`, the incremental path ``decode`` runs), with forward hooks on the
  attention weights (:func:`observe_attention`): every weight drawn is one the model's own forward pass computed,
  not a re-implementation (:func:`record_attention`);
* three kinds of attention per layer (section 3.2.3), each ``[h, Lq, Lk]``: the encoder's self-attention over the
  source pieces, the decoder's masked self-attention over its inputs (start token + output; future positions, which
  the causal mask hides, are grey), and the encoder-decoder attention of each output step over the source (the
  source-target alignment);
* pictures: every head of the chosen layer (default: the last) as its own labelled heatmap, every layer as a grid of
  its heads, an ``index.html`` that shows them all (``<img>`` tags of the PNGs beside it; no script, no network),
  and the matrices themselves (``attention.npz``, ``attention.json`` with the pieces) for other tools;
* the cost of a picture does not grow with the sentence: each head is one image (not an artist per cell), a long
  axis labels every k-th piece only (each label is a text matplotlib measures at every layout pass), the heads of a
  layer's grid share their axes' labels, and the figures' sizes are capped; a sentence of more than
  :data:`MAX_PIECES` pieces is refused, its cells too small to read.

The output directory is an artifact of kind ``attention`` (a manifest), written atomically.
"""

from __future__ import annotations

import contextlib
import html
import json
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from mtpipe.config import MAX_BEAM
from mtpipe.errors import MtpipeError

KINDS = ("encoder", "decoder", "cross")
TITLES = {
    "encoder": "encoder self-attention",
    "decoder": "decoder self-attention (masked)",
    "cross": "encoder-decoder attention",
}
# Axis names per kind: (rows = queries, columns = keys).
AXES = {
    "encoder": ("source (query)", "source (key)"),
    "decoder": ("decoder input (query)", "decoder input (key)"),
    "cross": ("output piece (step)", "source (key)"),
}
NPZ, JSON_FILE, INDEX = "attention.npz", "attention.json", "index.html"


@dataclass
class AttentionMaps:
    """One sentence's attention weights, every layer, with the pieces that label the axes.

    ``weights[kind][l]`` is layer l+1's ``[h, Lq, Lk]`` float32 array: encoder ``[h, S, S]``, decoder ``[h, T, T]``,
    cross ``[h, T, S]``, with S = source pieces + ``</s>`` and T = output pieces + ``</s>`` (the decoder's inputs are
    the start token + the output pieces: step t reads input t and produces output t).
    """

    text: str
    translation: str
    source: list[str]  # S source pieces, </s> last
    decoder_inputs: list[str]  # T decoder inputs: the start token, then the output pieces
    outputs: list[str]  # T output pieces, </s> last
    weights: dict[str, list[Any]]  # kind -> per layer [h, Lq, Lk] numpy float32


# --------------------------------------------------------------------------------------------------------------------
# The weights: the model's own forward pass, observed
# --------------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def observe_attention(model: Any) -> Iterator[dict[str, list[list[Any]]]]:
    """Keep the attention weights of every forward pass of ``model`` run inside the block: a forward hook on each
    attention's :class:`~mtpipe.model.attention.AttentionWeights`, removed on leaving. Yields ``{"encoder": ...,
    "decoder": ..., "cross": ...}``, each one list per layer of the ``[B, h, Lq, Lk]`` float32 weights of every call,
    in call order (one per step when decoding). The hooks see the eager forward only (not a compiled step, nor one
    replayed from CUDA graphs)."""
    groups = {"encoder": [layer.self_attn for layer in model.encoder],
              "decoder": [layer.self_attn for layer in model.decoder],
              "cross": [layer.cross_attn for layer in model.decoder]}
    kept: dict[str, list[list[Any]]] = {kind: [[] for _ in modules] for kind, modules in groups.items()}

    def keep(calls: list[Any]) -> Callable[..., None]:
        def hook(module: Any, inputs: Any, weights: Any) -> None:
            calls.append(weights.detach().float())
        return hook

    handles = [m.weights.register_forward_hook(keep(calls))
               for kind, modules in groups.items() for m, calls in zip(modules, kept[kind])]
    try:
        yield kept
    finally:
        for handle in handles:
            handle.remove()


def record_attention(model: Any, src_ids: list[int], out_ids: list[int]) -> dict[str, list[Any]]:
    """Every layer's attention weights while ``model`` encodes ``src_ids`` (EOS appended) and decodes ``out_ids``
    (EOS last) step by step, as decoding does (:func:`mtpipe.engine.variants.prepare`'s ``start`` / ``step``, the
    self-attention cache included), under :func:`observe_attention`.

    Returns ``{kind: [layer weights [h, Lq, Lk] (torch float32)]}``. Each step's rows (``[1, h, 1, Lk]``) are stacked
    into the ``[h, T, Lk]`` matrix; a decoder self-attention row covers the positions so far (with a restricted
    window, the last ``r + 1``), and later positions, hidden by the causal mask, are zero.
    """
    import torch

    from mtpipe.artifacts import EOS_ID

    src = torch.tensor([[*src_ids, EOS_ID]], dtype=torch.long)  # [1, S]
    tgt_in = [model.start_id, *out_ids[:-1]]  # the input of each step: what the step before produced
    steps = len(tgt_in)
    from mtpipe.engine.variants import prepare

    prepared = prepare(model, "fp32", torch.device("cpu"))  # as decoding runs it: the eager step, on the CPU
    with torch.inference_mode(), observe_attention(prepared.model) as kept:
        state = prepared.start(*prepared.encode(src))
        for token in tgt_in:
            _, state = prepared.step(torch.tensor([token], dtype=torch.long), state)

    encoder = [calls[0][0] for calls in kept["encoder"]]  # one call per layer: [1, h, S, S] -> [h, S, S]
    cross = [torch.cat([c[0] for c in calls], dim=1) for calls in kept["cross"]]  # T x [h, 1, S] -> [h, T, S]
    decoder = []
    for calls in kept["decoder"]:
        heads = calls[0].size(1)
        full = torch.zeros(heads, steps, steps)  # [h, T, T]; what a row does not cover was masked: weight 0
        for t, c in enumerate(calls):
            seen = c.size(-1)  # keys this step attended over: positions t+1-seen .. t
            full[:, t, t + 1 - seen : t + 1] = c[0, :, 0]  # [1, h, 1, seen] -> [h, seen]
        decoder.append(full)
    return {"encoder": encoder, "decoder": decoder, "cross": cross}


def attention_maps(model: Any, sp: Any, text: str, beam: int = 1, alpha: float = 0.6,
                   length_penalty: str = "gnmt") -> AttentionMaps:
    """Encode ``text`` as ``decode --input`` does, translate it (greedy, or beam search with ``beam``), and record
    the attention of decoding that translation (:func:`record_attention`)."""
    from mtpipe.artifacts import EOS_ID
    from mtpipe.engine.translate import translate_batches
    from mtpipe.engine.search import DecodeRules, LengthPenalty, max_source_len

    text = unicodedata.normalize("NFC", text).strip()  # as decode's read_lines cleans a line
    if not text:
        raise MtpipeError("--text: empty; give the sentence to translate")
    if "\n" in text:
        raise MtpipeError("--text: one sentence (one line) at a time")
    src_ids = sp.encode(text, out_type=int)
    limit = max_source_len(model.cfg.max_positions)
    if len(src_ids) > limit:
        raise MtpipeError(f"--text: {len(src_ids)} pieces, more than the model's {limit} (max_positions "
                          f"{model.cfg.max_positions} with EOS)")
    if len(src_ids) > MAX_PIECES:
        raise MtpipeError(f"--text: {len(src_ids)} pieces, more than the {MAX_PIECES} that attention draws (a "
                          "longer sentence's heatmap cells are too small to read); give a shorter sentence")
    rules = DecodeRules(beam=beam, penalty=LengthPenalty(length_penalty, alpha))
    best = translate_batches(model, [src_ids], rules, max_tokens=len(src_ids) + 1)[0][0]
    out_ids = [*best.tokens, EOS_ID]
    recorded = record_attention(model, src_ids, out_ids)
    return AttentionMaps(
        text=text,
        translation=sp.decode(best.tokens),
        source=[sp.id_to_piece(i) for i in [*src_ids, EOS_ID]],
        decoder_inputs=[sp.id_to_piece(i) for i in [model.start_id, *best.tokens]],
        outputs=[sp.id_to_piece(i) for i in out_ids],
        weights={kind: [w.numpy() for w in layers] for kind, layers in recorded.items()},
    )


# --------------------------------------------------------------------------------------------------------------------
# Pictures
# --------------------------------------------------------------------------------------------------------------------


def axis_pieces(maps: AttentionMaps, kind: str) -> tuple[list[str], list[str]]:
    """``(row labels, column labels)`` of ``kind``'s matrices."""
    if kind == "encoder":
        return maps.source, maps.source
    if kind == "decoder":
        return maps.decoder_inputs, maps.decoder_inputs
    return maps.outputs, maps.source


# The longest sentence drawn, in SentencePiece pieces (without </s>). A head's picture is at most 16 inches wide at
# 110 dpi (~1,760 pixels), and every layer's grid gives each head at most 7 inches at 90 dpi (~630 pixels): past
# 256 pieces a position gets under ~7 pixels in the one and ~2 in the other, too few to read.
MAX_PIECES = 256
# Tick labels per axis: a head's own picture, and each head of a layer's grid. Every label is a text artist whose size
# matplotlib measures at each layout pass (the cost of drawing a long sentence), so a longer axis labels every k-th
# position only, with its 1-based number.
HEAD_LABELS, GRID_LABELS = 64, 32


def tick_labels(pieces: list[str], most: int) -> tuple[list[int], list[str]]:
    """``(positions, labels)`` for an axis of ``pieces``: every piece when there are at most ``most``, else every
    k-th (k = ceil(n / most)), labelled ``"<1-based position> <piece>"`` so that a thinned axis still says where it
    is."""
    step = max(1, -(-len(pieces) // most))
    if step == 1:
        return list(range(len(pieces))), list(pieces)
    at = list(range(0, len(pieces), step))
    return at, [f"{i + 1} {pieces[i]}" for i in at]


def _heatmap(ax: Any, w: Any, rows: list[str], cols: list[str], kind: str, most: int, scale: float = 1.0) -> Any:
    """One head's ``[Lq, Lk]`` weights on ``ax`` as one image (one artist, whatever the sentence's length), pieces on
    both axes (at most ``most`` labels each, :func:`tick_labels`); positions the causal mask hides are grey (their
    weight is 0 by construction, not by what the model learned)."""
    import numpy as np

    from matplotlib import colormaps

    cmap = colormaps["viridis"].with_extremes(bad="#d9d9d9")
    shown = w
    if kind == "decoder":
        shown = np.ma.masked_array(w, mask=np.triu(np.ones_like(w, dtype=bool), k=1))  # future keys: j > i
    image = ax.imshow(shown, cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest")
    x_at, x_labels = tick_labels(cols, most)
    y_at, y_labels = tick_labels(rows, most)
    fontsize = _font(max(len(x_at), len(y_at))) * scale
    ax.set_xticks(x_at, x_labels, rotation=90, fontsize=fontsize)
    ax.set_yticks(y_at, y_labels, fontsize=fontsize)
    ax.tick_params(length=0)
    return image


def _font(n: int) -> float:
    """Tick label size for n labels: smaller for long sentences, so that labels do not overlap."""
    return max(5.0, min(10.0, 220.0 / max(n, 1)))


def head_figure(maps: AttentionMaps, kind: str, layer: int, head: int) -> Any:
    """One head of one layer (1-based numbers) as a matplotlib Figure, with a colour bar: one image, at most
    :data:`HEAD_LABELS` tick labels per axis, at most 16 inches square."""
    from matplotlib.figure import Figure

    w = maps.weights[kind][layer - 1][head - 1]  # [Lq, Lk]
    rows, cols = axis_pieces(maps, kind)
    size = min(16.0, 2.5 + 0.32 * max(len(rows), len(cols)))
    fig = Figure(figsize=(size + 1.2, size), layout="constrained")
    ax = fig.add_subplot()
    image = _heatmap(ax, w, rows, cols, kind, HEAD_LABELS)
    heads = len(maps.weights[kind][layer - 1])
    layers = len(maps.weights[kind])
    ax.set_title(f"{TITLES[kind]}: layer {layer} of {layers}, head {head} of {heads}", fontsize=11)
    ax.set_ylabel(AXES[kind][0])
    ax.set_xlabel(AXES[kind][1])
    fig.colorbar(image, ax=ax, shrink=0.8, label="attention weight")
    return fig


def draw_head(path: Path, maps: AttentionMaps, kind: str, layer: int, head: int) -> None:
    """:func:`head_figure` as a PNG."""
    head_figure(maps, kind, layer, head).savefig(path, dpi=110)


def layer_figure(maps: AttentionMaps, kind: str, layer: int) -> Any:
    """Every head of one layer (1-based) side by side in one Figure, one colour bar for all: one image per head, at
    most :data:`GRID_LABELS` tick labels per axis of each, each head at most 7 inches square."""
    import math

    from matplotlib.figure import Figure

    ws = maps.weights[kind][layer - 1]  # [h, Lq, Lk]
    heads = len(ws)
    rows, cols = axis_pieces(maps, kind)
    n = max(len(rows), len(cols))
    per_row = min(heads, 4)
    grid_rows = math.ceil(heads / per_row)
    cell = min(7.0, 1.8 + 0.2 * n)
    fig = Figure(figsize=(cell * per_row + 1.0, cell * grid_rows + 0.6), layout="constrained")
    # The heads share both axes: pieces label the left column and the bottom panel of each column only.
    axes = fig.subplots(grid_rows, per_row, squeeze=False, sharex=True, sharey=True)
    image = None
    for h in range(grid_rows * per_row):
        ax = axes[h // per_row][h % per_row]
        if h >= heads:
            ax.set_axis_off()
            continue
        image = _heatmap(ax, ws[h], rows, cols, kind, GRID_LABELS, scale=0.75)
        ax.tick_params(labelleft=h % per_row == 0, labelbottom=h + per_row >= heads)
        ax.set_title(f"head {h + 1}", fontsize=9)
    fig.suptitle(f"{TITLES[kind]}: layer {layer} of {len(maps.weights[kind])}, all {heads} heads "
                 f"(rows: {AXES[kind][0]}, columns: {AXES[kind][1]})", fontsize=11)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    return fig


def draw_layer(path: Path, maps: AttentionMaps, kind: str, layer: int) -> None:
    """:func:`layer_figure` as a PNG."""
    layer_figure(maps, kind, layer).savefig(path, dpi=90)


def head_file(kind: str, layer: int, head: int) -> str:
    return f"{kind}-layer{layer}-head{head}.png"


def layer_file(kind: str, layer: int) -> str:
    return f"{kind}-layer{layer}.png"


def index_html(maps: AttentionMaps, layer: dict[str, int], checkpoint: str) -> str:
    """The page: the sentence and its translation, the chosen layer's heads one by one, then every layer's grid.
    Only ``<img>`` tags of the PNGs beside it: it opens offline, from any folder it is copied to with them."""
    from mtpipe.stages.plots import html_page

    esc = html.escape
    parts = [f"<p><b>source</b>: {esc(maps.text)}<br><b>translation</b>: {esc(maps.translation)}<br>"
             f"<b>checkpoint</b>: {esc(checkpoint)}</p>",
             "<p>Rows attend to columns; each row sums to 1. Grey cells are future positions that the decoder's "
             "causal mask hides (section 3.2.3).</p>"]
    for kind in KINDS:
        n_layers, n_heads = len(maps.weights[kind]), len(maps.weights[kind][0])
        parts.append(f"<h2>{esc(TITLES[kind])}, layer {layer[kind]} of {n_layers}: each head</h2>")
        parts.extend(f'<img src="{head_file(kind, layer[kind], h)}" alt="{esc(TITLES[kind])} layer {layer[kind]} '
                     f'head {h}">' for h in range(1, n_heads + 1))
    parts.append("<h2>Every layer</h2>")
    for kind in KINDS:
        parts.append(f"<h3>{esc(TITLES[kind])}</h3>")
        parts.extend(f'<img class="wide" src="{layer_file(kind, i)}" alt="{esc(TITLES[kind])} layer {i}">'
                     for i in range(1, len(maps.weights[kind]) + 1))
    return html_page(f"Attention: {maps.text}", parts)


def write_attention(out: Path, maps: AttentionMaps, layer: dict[str, int], checkpoint: Path, tokens: Path | None,
                    *, beam: int, force: bool = False) -> list[str]:
    """The ``attention`` artifact: the PNGs (the chosen layer's heads, every layer's grid), ``index.html``,
    ``attention.npz`` (``{kind}_layer{l}`` = ``[h, Lq, Lk]``) and ``attention.json`` (pieces, translation,
    layers); returns the PNG names."""
    import numpy as np

    from mtpipe import writing
    from mtpipe.console import progress

    jobs = [(head_file(kind, layer[kind], h), kind, layer[kind], h) for kind in KINDS
            for h in range(1, len(maps.weights[kind][0]) + 1)]
    jobs += [(layer_file(kind, i), kind, i, 0) for kind in KINDS for i in range(1, len(maps.weights[kind]) + 1)]
    upstream = {"checkpoint": checkpoint, **({"tokens": tokens} if tokens is not None else {})}
    with writing.ArtifactWriter(out, "attention", {}, upstream=upstream, force=force) as w:
        with progress() as bar:
            task = bar.add_task("draw", total=len(jobs))
            for name, kind, i, h in jobs:
                if h:
                    draw_head(w.path(name), maps, kind, i, h)
                else:
                    draw_layer(w.path(name), maps, kind, i)
                bar.advance(task)
        arrays = {f"{kind}_layer{i + 1}": a for kind in KINDS for i, a in enumerate(maps.weights[kind])}
        with open(w.path(NPZ), "wb") as f:
            np.savez_compressed(f, **arrays)
        info = {"text": maps.text, "translation": maps.translation, "source_pieces": maps.source,
                "decoder_input_pieces": maps.decoder_inputs, "output_pieces": maps.outputs, "layer": layer,
                "layers": {kind: len(maps.weights[kind]) for kind in KINDS},
                "heads": len(maps.weights["encoder"][0]), "beam": beam, "checkpoint": str(checkpoint),
                "arrays": {k: list(a.shape) for k, a in arrays.items()}}
        w.path(JSON_FILE).write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        w.path(INDEX).write_text(index_html(maps, layer, str(checkpoint)), encoding="utf-8")
        w.extra.update({"text": maps.text, "translation": maps.translation, "layer": layer, "beam": beam})
    return [job[0] for job in jobs]


# --------------------------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------------------------


def chosen_layers(layer: int | None, encoder_layers: int, decoder_layers: int) -> dict[str, int]:
    """The 1-based layer drawn head by head in each stack: ``layer`` in both, or each stack's last."""
    if layer is None:
        return {"encoder": encoder_layers, "decoder": decoder_layers, "cross": decoder_layers}
    if not 1 <= layer <= min(encoder_layers, decoder_layers):
        raise MtpipeError(f"--layer {layer}: out of range; the model has {encoder_layers} encoder and "
                          f"{decoder_layers} decoder layers (1 to {min(encoder_layers, decoder_layers)})")
    return {"encoder": layer, "decoder": layer, "cross": layer}


def attention_command(checkpoint: Path, tokens: Path | None, text: str | None, out: Path | None,
                      layer: int | None = None, beam: int = 1, alpha: float = 0.6, *, length_penalty: str = "gnmt",
                      force: bool = False) -> None:
    """``mtpipe attention``: check the inputs, translate ``text`` while recording its attention, draw it into ``out``
    (every check before any work; nothing is written on an error). ``tokens`` None: the checkpoint's own
    SentencePiece model (:func:`mtpipe.engine.loading.vocab_source`)."""
    import torch

    from mtpipe.console import info, table
    from mtpipe.engine.loading import open_checkpoint

    if out is None:
        raise MtpipeError("--out: required (the directory for the pictures)")
    if text is None or not text.strip():
        raise MtpipeError("--text: empty; give the sentence to translate")
    if not 1 <= beam <= MAX_BEAM:
        raise MtpipeError(f"--beam {beam}: must be between 1 (greedy search) and {MAX_BEAM}")
    if not Path(checkpoint).is_dir():
        raise MtpipeError(f"{checkpoint}: checkpoint not found (--checkpoint: a checkpoint directory)")
    if tokens is not None and not Path(tokens).is_dir():
        raise MtpipeError(f"{tokens}: bpe artifact not found (--tokens: the directory with spm.model)")
    loaded = open_checkpoint(checkpoint, tokens)  # as every command opens a checkpoint's model
    model = loaded.model
    layers = chosen_layers(layer, len(model.encoder), len(model.decoder))
    torch.manual_seed(0)  # nothing here is random (eval mode); set anyway, so that a run repeats exactly
    maps = attention_maps(model, loaded.sp, text, beam=beam, alpha=alpha, length_penalty=length_penalty)
    info(f"[bold]source[/bold]      {maps.text}\n[bold]translation[/bold] {maps.translation}")
    pngs = write_attention(out, maps, layers, checkpoint, loaded.tokens, beam=beam, force=force)
    table(f"attention: {out}", ["", "value"], [
        ["checkpoint", f"{checkpoint} (step {loaded.ck.step:,})"],
        ["source pieces (with </s>)", len(maps.source)],
        ["output pieces (with </s>)", len(maps.outputs)],
        ["search", "greedy" if beam == 1 else f"beam {beam}, {length_penalty} alpha {alpha:g}"],
        ["layers (encoder / decoder)", f"{len(model.encoder)} / {len(model.decoder)}"],
        ["heads", len(maps.weights["encoder"][0])],
        ["layer drawn head by head", ", ".join(f"{k} {v}" for k, v in layers.items())],
        ["pictures", len(pngs)],
        ["page", str(Path(out) / INDEX)],
    ])


__all__ = ["AttentionMaps", "KINDS", "MAX_PIECES", "attention_command", "attention_maps", "chosen_layers",
           "head_figure", "layer_figure", "observe_attention", "record_attention", "tick_labels", "write_attention"]
