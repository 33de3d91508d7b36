"""params.yaml's sections: one frozen dataclass each, with every rule its values must follow, however it is built.

A key's own rules (type, range, choices) are its field's (:func:`mtpipe.sections._h`); rules across keys of a section,
its :meth:`Section.check`; rules across sections, :func:`check_sections`. The sections of the commands that use a
trained model (decode, score, export, serve) are in :mod:`mtpipe.config_inference`; all of them are read from here. Each field is also a flag of the commands that
read its section, so ``dvc.yaml`` passes paths only. :mod:`mtpipe.params` layers params.yaml and flags into sections.
Light (no torch, no pyarrow): the CLI builds its options from these classes at start-up.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Optional

from mtpipe import registry
from mtpipe.config_inference import (MAX_BEAM, PRUNE_HELP, RECORDED_DECODE, DecodeConfig, ExportConfig, ScoreConfig,
                                     ServeConfig)
from mtpipe.errors import MtpipeError
from mtpipe.sections import Section, _h, check_rules, to_dict

# The sections of mtpipe.config_inference, the limits and rules of mtpipe.sections: read from here like the rest.
_ = (MAX_BEAM, PRUNE_HELP, RECORDED_DECODE, DecodeConfig, ExportConfig, ScoreConfig, ServeConfig, check_rules, to_dict)


@dataclass(frozen=True)
class FetchConfig(Section):
    """``fetch``: where the parallel corpus comes from and how train is cleaned."""

    SECTION: typing.ClassVar[str] = "fetch"

    source: str = _h("Corpus: 'hf:REPO[:CONFIG]' (Hugging Face dataset, or 'hf:PATH' for a local one), or a local "
                     "directory ({split}.{lang}[.gz] parallel files, {split}.tsv, {split}.parquet, or a saved "
                     "`datasets` directory).", default="hf:bentrevett/multi30k")
    src_lang: str = _h("Source language code (column / file suffix).", default="en")
    tgt_lang: str = _h("Target language code (column / file suffix).", default="de")
    splits: dict = _h(
        "Output split -> source split name, or a list of candidate names (the first that exists is used; the "
        "output split's own name is tried first unless the list names it), e.g. "
        # Brackets escaped: the CLI help is rich markup, where '[...]' would vanish as a style tag.
        "{train: train, valid: \\[validation, val], test: \\[test, test_2016_flickr]}.",
        default_factory=lambda: {
            "train": ["train"],
            "valid": ["validation", "valid", "val", "dev"],
            "test": ["test", "test_2016_flickr"],
        },
    )
    min_len: int = _h("Train: drop pairs with a side shorter than this many whitespace words.", default=1, ge=0)
    max_len: int = _h("Train: drop pairs with a side longer than this many whitespace words.", default=250, ge=1)
    max_ratio: float = _h("Train: drop pairs whose word-length ratio exceeds this (Moses clean-corpus-n).",
                          default=9.0, ge=1)
    dedup: bool = _h("Train: drop exact duplicate (src, tgt) pairs.", default=True)
    revision: Optional[str] = _h("Hugging Face dataset revision (git tag / commit) for reproducibility.", default=None)
    train_slice: str = _h("Train: only the rows START:END of the source's train split (0-based, END excluded, either "
                          "may be left out: '14500:'), taken before cleaning; ids stay the rows' indices. '' = all.",
                          default="")
    hypotheses: Optional[str] = _h("Train: a hypotheses artifact (mtpipe decode --out) of the train split of "
                                   "fetch.source, which must then be a corpus artifact: its translations replace "
                                   "that corpus's target side, matched by id (back-translation, distillation). "
                                   "null = the source's own pairs.", default=None)
    tag: str = _h("Train: a token put before every source sentence of this source's train pairs (tagged "
                  "back-translation, Caswell et al. 2019); valid and test are never tagged. '' = none.", default="")
    add_train: list = _h("More train sources, appended after fetch.source's train split and cleaned with it (one "
                         "set of duplicates): a list of mappings with the keys source (required), train_slice, "
                         "hypotheses and tag, each as the fetch key of that name. Their ids follow the rows before "
                         "them.", default_factory=list)

    def check(self) -> None:
        if self.src_lang == self.tgt_lang:
            raise MtpipeError(f"fetch.src_lang and fetch.tgt_lang are both '{self.src_lang}'")
        if self.max_len < max(self.min_len, 1):
            raise MtpipeError(f"fetch.min_len={self.min_len} / fetch.max_len={self.max_len}: need 0 <= min_len <= "
                              "max_len")
        train_slice(self.train_slice, "fetch.train_slice")
        for i, entry in enumerate(self.add_train):
            where = f"fetch.add_train[{i}]"
            if not isinstance(entry, dict) or not isinstance(entry.get("source"), str) or not entry["source"]:
                raise MtpipeError(f"{where}: must be a mapping with a 'source' (and optionally train_slice, "
                                  f"hypotheses, tag), got {entry!r}")
            for key, value in entry.items():
                if key not in ("source", "train_slice", "hypotheses", "tag"):
                    raise MtpipeError(f"{where}: unknown key '{key}' (known: source, train_slice, hypotheses, tag)")
                if not (isinstance(value, str) or (key == "hypotheses" and value is None)):
                    raise MtpipeError(f"{where}.{key} = {value!r} is not a string")
            train_slice(entry.get("train_slice", ""), f"{where}.train_slice")


def train_slice(text: str, key: str) -> tuple[int, Optional[int]]:
    """``fetch.train_slice`` "START:END" -> (start, end or None); '' is every row."""
    start, colon, end = text.partition(":")
    try:
        if not text.strip():
            return 0, None
        if not colon:
            raise ValueError
        first, last = int(start) if start.strip() else 0, int(end) if end.strip() else None
    except ValueError:
        raise MtpipeError(f"{key} = {text!r}: expected START:END (row numbers, either may be left out)") from None
    if first < 0 or (last is not None and last <= first):
        raise MtpipeError(f"{key} = {text!r}: need 0 <= START < END")
    return first, last


@dataclass(frozen=True)
class BpeConfig(Section):
    """``bpe``: the joint SentencePiece BPE model (paper section 5.1)."""

    SECTION: typing.ClassVar[str] = "bpe"

    vocab_size: int = _h("Joint BPE vocabulary size (paper: ~37000 en-de, 32000 en-fr).", default=8000)
    character_coverage: float = _h("SentencePiece character coverage.", default=1.0, gt=0, le=1)
    sample_sentences: int = _h("Cap on sentences (both sides together) sampled for BPE training on big corpora.",
                               default=10_000_000, ge=1)
    threads: int = _h("Threads for training and encoding (0 = all cores).", default=0, ge=0)
    seed: int = _h("Seed for the training-sentence sample and the BPE-dropout samples.", default=1)
    dropout: float = _h("BPE-dropout (Provilkov et al. 2020): each merge is skipped with this probability when the "
                        "dropout_copies extra encodings of train are made, so the model sees each sentence split into "
                        "pieces in several ways (a regulariser for small corpora). 0 = off.", default=0.0, ge=0, lt=1)
    dropout_copies: int = _h("Extra encodings of train with bpe.dropout, each a different sample, stored after the "
                             "usual one (an epoch then covers 1 + dropout_copies encodings); valid and test are "
                             "never sampled.", default=0, ge=0)
    from_model: Optional[str] = _h("A checkpoint directory (trained, averaged or imported) whose SentencePiece model "
                                   "encodes the corpus instead of a newly trained one: the vocabulary of the model to "
                                   "fine-tune (train.finetune_from), identical by construction; vocab_size, "
                                   "character_coverage and sample_sentences are then unused. null = train a new "
                                   "model.", default=None)

    def check(self) -> None:
        if self.vocab_size <= SPECIAL_TOKENS:
            raise MtpipeError(f"bpe.vocab_size={self.vocab_size}: must be larger than the {SPECIAL_TOKENS} special "
                              "tokens")
        if (self.dropout > 0) != (self.dropout_copies > 0):
            raise MtpipeError(f"bpe.dropout={self.dropout} with bpe.dropout_copies={self.dropout_copies}: BPE-dropout "
                              "needs both (a probability > 0 and at least one extra copy of train), or neither")
        if self.from_model is not None and not self.from_model.strip():
            raise MtpipeError("bpe.from_model: an empty path (null: train a new SentencePiece model)")


SPECIAL_TOKENS = 4  # pad, unk, bos, eos: the first ids of every vocabulary (mtpipe.artifacts.SPECIALS)


@dataclass(frozen=True)
class BucketConfig(Section):
    """``bucket``: token-based batching (paper section 5.1: ~25k source + ~25k target tokens per step)."""

    SECTION: typing.ClassVar[str] = "bucket"

    max_tokens: int = _h("Per-batch cap on padded tokens per side (a micro-batch's at most).", default=4096, ge=1)
    max_len: int = _h("Train pairs with a side longer than this many positions (incl. EOS) are dropped.",
                      default=256, ge=2)
    multiple_of: int = _h("Sentence count per batch is a multiple of this (tensor-core friendly).", default=8, ge=1)

    def check(self) -> None:
        if self.max_tokens < self.max_len:
            raise MtpipeError(
                f"bucket.max_tokens={self.max_tokens} is smaller than bucket.max_len={self.max_len}: the longest "
                f"allowed pair would not fit in any batch; raise --max-tokens to at least {self.max_len} or lower "
                "--max-len")


@dataclass(frozen=True)
class ModelConfig(Section):
    """``model``: the Transformer's shape (paper section 3 and Table 3). ``null`` fields take the preset's value."""

    SECTION: typing.ClassVar[str] = "model"

    preset: str = _h("Preset: base, big (paper), small, tiny (CPU-sized).", default="base",
                     choices=("base", "big", "small", "tiny"))
    encoder_layers: Optional[int] = _h("N, encoder layers.", default=None, ge=1)
    decoder_layers: Optional[int] = _h("N, decoder layers.", default=None, ge=1)
    d_model: Optional[int] = _h("d_model.", default=None, ge=1)
    d_ff: Optional[int] = _h("d_ff, inner size of the feed-forward layers.", default=None, ge=1)
    heads: Optional[int] = _h("h, attention heads.", default=None, ge=1)
    d_k: Optional[int] = _h("d_k, query/key size per head (default d_model / h).", default=None, ge=1)
    d_v: Optional[int] = _h("d_v, value size per head (default d_model / h).", default=None, ge=1)
    dropout: Optional[float] = _h("P_drop on residuals and embedding sums.", default=None, ge=0, lt=1)
    attention_dropout: Optional[float] = _h("Dropout on attention weights (paper: 0).", default=None, ge=0, lt=1)
    relu_dropout: Optional[float] = _h("Dropout after the FFN ReLU (paper: 0).", default=None, ge=0, lt=1)
    max_positions: Optional[int] = _h("Longest sequence the model accepts (positions table size).", default=None, ge=1)
    # Variants (mtpipe.model.transformer's docstring; off by default: the paper's model).
    norm_position: str = _h("post: LayerNorm(x + F(x)) (the paper); pre: x + F(Norm(x)) with a final norm on each "
                            "stack (Nguyen & Salazar 2019).", default="post", choices=("post", "pre"))
    norm: str = _h("layer: LayerNorm (the paper); scale: ScaleNorm g * x / ||x||, one learned g per norm, "
                   "initialised to sqrt(d_model) (Nguyen & Salazar 2019).", default="layer", choices=("layer", "scale"))
    fixnorm: bool = _h("FixNorm: word embeddings normalised to unit length, times one learned g (initialised to "
                       "sqrt(d_model), replacing the fixed sqrt(d_model)); the output projection uses the same "
                       "unit-length rows.", default=False)
    positions: str = _h("sinusoidal (the paper, section 3.5), learned (Table 3 row E; one table for both stacks, "
                        "max_positions rows) or learned-per-stack (a table each, as fairseq's learned positions).",
                        default="sinusoidal", choices=("sinusoidal", "learned", "learned-per-stack"))
    share_embeddings: str = _h("all: one matrix for the source and target embeddings and the pre-softmax projection "
                               "(the paper, section 3.4); decoder: the target embedding and the projection share one, "
                               "the source has its own; none: three matrices.", default="all",
                               choices=("all", "decoder", "none"))
    output_bias: bool = _h("A learned bias on the pre-softmax projection (the paper has none; `mtpipe import` uses it "
                           "to keep pieces the original vocabulary lacks out of the softmax).", default=False)
    decoder_start: str = _h("The decoder's first input token: bos (<s>, mtpipe's) or eos (</s>, as fairseq and "
                            "Marian start decoding).", default="bos", choices=("bos", "eos"))
    init: str = _h("Weight initialisation. xavier: every projection matrix Xavier-uniform over its whole shape, "
                   "biases 0 (mtpipe's default). fairseq: as fairseq 0.12's transformer, each query, key and value "
                   "matrix Xavier-uniform with gain 1/sqrt(2), their biases and the feed-forward layers PyTorch's "
                   "nn.Linear default U(+-1/sqrt(fan_in)): smaller feed-forward weights. Embeddings are "
                   "N(0, d_model^-0.5) either way.", default="xavier", choices=("xavier", "fairseq"))
    layerdrop: float = _h("LayerDrop p (Fan et al. 2019): in training each encoder and decoder layer is skipped with "
                          "probability p (paper: 0.2); `--prune` removes layers at inference.", default=0.0, ge=0, lt=1)
    attention_window: int = _h("Restricted self-attention (paper section 4): r > 0 lets each position attend only to "
                               "positions within r of it (the decoder: itself and the r before it); encoder-decoder "
                               "attention stays full. 0: full attention (the paper's models).", default=0, ge=0)

    def resolved(self) -> "ModelConfig":
        """Fill every ``None`` from the preset; derive d_k/d_v; validate."""
        base = MODEL_PRESETS[self.preset]
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for k, v in base.items():
            if values.get(k) is None:
                values[k] = v
        if values["d_model"] % values["heads"] and (values["d_k"] is None or values["d_v"] is None):
            raise MtpipeError(f"model: d_model={values['d_model']} is not divisible by heads={values['heads']}; set "
                              "d_k and d_v")
        for k in ("d_k", "d_v"):
            if values[k] is None:
                values[k] = values["d_model"] // values["heads"]
        return ModelConfig(**values)  # the preset's values pass the fields' rules too


def with_model_defaults(model_config: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's model config with the fields it predates (the variants) at their defaults, so checkpoints
    written before a field existed compare equal to new ones of the same model (resume, averaging)."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)
                if f.default not in (None, dataclasses.MISSING)}
    return {**{k: v for k, v in defaults.items() if k not in model_config}, **model_config}


# Paper Table 3 rows "base" and "big"; small/tiny are sized for a laptop CPU.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "base": dict(encoder_layers=6, decoder_layers=6, d_model=512, d_ff=2048, heads=8, dropout=0.1,
                 attention_dropout=0.0, relu_dropout=0.0, max_positions=1024),
    "big": dict(encoder_layers=6, decoder_layers=6, d_model=1024, d_ff=4096, heads=16, dropout=0.3,
                attention_dropout=0.0, relu_dropout=0.0, max_positions=1024),
    "small": dict(encoder_layers=3, decoder_layers=3, d_model=256, d_ff=1024, heads=4, dropout=0.1,
                  attention_dropout=0.0, relu_dropout=0.0, max_positions=1024),
    "tiny": dict(encoder_layers=2, decoder_layers=2, d_model=64, d_ff=128, heads=2, dropout=0.1,
                 attention_dropout=0.0, relu_dropout=0.0, max_positions=512),
}




@dataclass(frozen=True)
class TrainConfig(Section):
    """``train``: optimisation (paper section 5.3-5.4), precision, stopping and checkpointing."""

    SECTION: typing.ClassVar[str] = "train"

    seed: int = _h("Random seed (model init, dropout, batch order).", default=1, ge=0)
    nproc: str = _h("Processes for the torchrun launcher: 'auto' (every visible GPU, else 1 CPU process) or a number.",
                    default="auto")
    tokens_per_update: int = _h("Target tokens per optimizer step across all processes (paper ~25000): "
                                "ceil(tokens_per_update / bucket.max_tokens) batches per update on any number of "
                                "processes (accumulated, or shared by more processes than batches; within 10 %).",
                                default=25000, ge=1)
    max_steps: int = _h("Stop after this many updates (paper: base 100k, big 300k). 0 = no limit.", default=100_000,
                        ge=0)
    max_epochs: int = _h("Stop after this many epochs. 0 = no limit.", default=0, ge=0)
    max_time: float = _h("Stop after this many minutes of training. 0 = no limit.", default=0.0, ge=0)
    lr_scale: float = _h("Multiplier on the paper's learning-rate formula.", default=1.0, gt=0)
    warmup: int = _h("warmup_steps of the paper's schedule.", default=4000, ge=1)
    schedule: str = _h("Learning-rate schedule: 'inverse_sqrt' (the paper, section 5.3) or 'linear' (budgeted "
                       "training, Li et al. 2020: the paper's warm-up line, then a straight line to zero exactly where "
                       "the budget ends: the first of max_steps, max_epochs, max_time; time measured as it goes).",
                       default="inverse_sqrt", choices=("inverse_sqrt", "linear"))
    adam_beta1: float = _h("Adam beta1.", default=0.9)
    adam_beta2: float = _h("Adam beta2.", default=0.98)
    adam_eps: float = _h("Adam epsilon.", default=1e-9, gt=0)
    clip_norm: float = _h("Clip the gradient norm to this (0 = no clipping).", default=0.0, ge=0)
    label_smoothing: float = _h("epsilon_ls (paper section 5.4).", default=0.1, ge=0, lt=1)
    precision: str = _h("fp32, bf16 (autocast, GPU and CPU), fp16 (GPU, grad scaler) or auto: bf16 on a GPU that "
                        "torch reports bf16 support for and on a CPU with native bf16 (AVX-512 bf16 / AMX), else fp16 "
                        "with a grad scaler on a GPU and fp32 on a CPU. The paper's arithmetic is fp32.",
                        default="auto", choices=("auto", "fp32", "bf16", "fp16"))
    compile: bool = _h("torch.compile the model's forward (the first updates pay its compilation).", default=False)
    grad_allreduce: str = _h("DDP's gradient all-reduce in fp32 (exact) or bf16 (half the bytes; rounded to bf16 "
                             "before the sum).", default="fp32", choices=("fp32", "bf16"))
    prefetch: int = _h("Updates whose batches a thread collates and pins ahead, on GPUs (0: in line).", default=2, ge=0)
    threads: int = _h("CPU threads per process (0 = torch's default in one process; with train.nproc > 1 the CPUs "
                      "shared among the processes, unless OMP_NUM_THREADS is set).", default=0, ge=0)
    save_every_minutes: float = _h("Checkpoint every this many minutes (paper: 10). 0 = off.", default=10.0, ge=0)
    save_every_steps: int = _h("Checkpoint every this many updates. 0 = off.", default=0, ge=0)
    save_every_progress: float = _h("Checkpoint each time this fraction of the budget (the first of max_steps, "
                                    "max_epochs, max_time to run out) has passed, e.g. 0.05 = every 5 %, so that "
                                    "the last checkpoints averaged lie in the run's final stretch. 0 = off.",
                                    default=0.0, ge=0, lt=1)
    keep_last: int = _h("Keep this many most recent checkpoints (>= the average stage's count).", default=20, ge=1)
    valid_every_steps: int = _h("Validation loss/perplexity every this many updates. 0 = only at the end.",
                                default=1000, ge=0)
    valid_bleu_every_steps: int = _h("Validation BLEU (sacreBLEU 13a on the detokenised valid sentences, logged as "
                                     "valid/bleu) every this many updates. 0 = off.", default=0, ge=0)
    valid_bleu_sentences: int = _h("Valid sentences decoded for validation BLEU: a fixed, evenly spaced subset of "
                                   "this many (0 = all).", default=500, ge=0)
    valid_bleu_beam: int = _h("Beam size of validation BLEU decoding (1 = greedy search; at most decode.beam's "
                              "limit).", default=1, ge=1, le=MAX_BEAM)
    stop_metric: str = _h("The validation metric that picks the best checkpoint and drives train.patience: "
                          "valid_ppl (lower is better; every valid_every_steps) or valid_bleu (higher is better; "
                          "every valid_bleu_every_steps).", default="valid_ppl", choices=("valid_ppl", "valid_bleu"))
    patience: int = _h("Early stopping: stop after this many validations of train.stop_metric in a row without "
                       "improvement. 0 = off.", default=0, ge=0)
    log_every_steps: int = _h("Log training metrics every this many updates.", default=10, ge=1)
    max_bad_steps: int = _h("Stop with an error after this many non-finite losses in a row.", default=5, ge=1)
    max_overflow_steps: int = _h("fp16: stop with an error naming the loss scale and the last checkpoint after this "
                                 "many updates in a row skipped for inf/nan gradients with a finite loss (each halves "
                                 "the loss scale: 30 leave 2^-30 of it, a run that no longer learns).", default=30, ge=1)
    device: str = _h("auto (cuda:LOCAL_RANK when a GPU is visible, else cpu), cpu or cuda.", default="auto")
    max_restarts: int = _h("torchrun --max-restarts for the stages/train.py launcher: a crashed worker group is "
                           "restarted and resumes from the last checkpoint.", default=0, ge=0)
    dist_timeout: float = _h("Seconds the processes of a multi-process run wait for one another before they fail "
                             "with one line naming what stopped answering: a rank or node that died, froze or lost "
                             "the network (each process watches the others' heartbeats), torchrun's store, a "
                             "collective that gets no answer, the nodes' rendezvous. 600 = NCCL's own default: room "
                             "for the slowest rank's torch.compile or a big checkpoint written to slow storage.",
                             default=600.0, gt=0)
    drophead_start: float = _h("Scheduled DropHead (Zhou et al. 2020): probability of dropping a whole attention head "
                               "at step 0; it falls linearly to 0 at train.warmup, then rises to drophead_end at the "
                               "last step. 0 = off.", default=0.0, ge=0, lt=1)
    drophead_end: Optional[float] = _h("DropHead probability at the last step (null = drophead_start).", default=None,
                                       ge=0, lt=1)
    finetune_from: Optional[str] = _h(
        "Fine-tuning (domain adaptation): a checkpoint directory (a training checkpoint, an `mtpipe average` output "
        "or an `mtpipe import`ed model) whose weights the run starts from, with a fresh optimizer, schedule (warm-up "
        "from step 1) and step counter. The model is the parent's: model keys left at their defaults are taken from "
        "it, a key set otherwise must equal the parent's value (else refused, naming the key). The tokens must be "
        "encoded with the parent's SentencePiece model (bpe.from_model). A run folder that already has checkpoints "
        "resumes from them instead. null = train from scratch.", default=None)

    def check(self) -> None:
        """Something must stop training, and DropHead's schedule needs a known last step."""
        if not (self.max_steps > 0 or self.max_epochs > 0 or self.max_time > 0):
            raise MtpipeError("train.max_steps/max_epochs/max_time: are all 0: set at least one stopping criterion")
        drophead = self.drophead_start > 0 or (self.drophead_end or 0.0) > 0
        if drophead and not (self.max_steps > 0 or self.max_epochs > 0):
            raise MtpipeError("train.drophead_start/drophead_end: the schedule rises to drophead_end at the last "
                              "step: set train.max_steps or train.max_epochs")
        if self.stop_metric == "valid_bleu" and self.valid_bleu_every_steps == 0:
            raise MtpipeError("train.stop_metric=valid_bleu: needs validation BLEU: set train.valid_bleu_every_steps "
                              "> 0 (or use stop_metric valid_ppl)")
        if self.patience and self.stop_metric == "valid_ppl" and self.valid_every_steps == 0:
            raise MtpipeError("train.patience: counts validations of valid_ppl, which train.valid_every_steps=0 turns "
                              "off: set train.valid_every_steps > 0")
        if self.finetune_from is not None and not self.finetune_from.strip():
            raise MtpipeError("train.finetune_from: an empty path (null: train from scratch)")


@dataclass(frozen=True)
class AverageConfig(Section):
    """``average``: checkpoint averaging (paper section 6.1)."""

    SECTION: typing.ClassVar[str] = "average"

    last: int = _h("Average the last N checkpoints by step (paper: base 5, big 20).", default=5, ge=1)
    up_to_step: Optional[int] = _h("Only consider checkpoints at or before this step.", default=None, ge=0)
    allow_fewer: bool = _h("Warn instead of failing when fewer checkpoints than asked exist.", default=False)
    select: str = _h("Which N (= average.last) checkpoints: last (the newest by step) or best (the best by the "
                     "run's train.stop_metric, as recorded in the checkpoints validated when they were written).",
                     default="last", choices=("last", "best"))
    prune: str = _h(PRUNE_HELP, default="")


def check_sections(**sections: Any) -> None:
    """The rules across the sections one command reads, given by name (model=, train=, serve=, decode=; one missing:
    skipped). Called where a command's sections are resolved (:mod:`mtpipe.cli`) and by the trainer's update."""
    model, train = sections.get("model"), sections.get("train")
    if model is not None and train is not None and train.compile and (model.layerdrop or 0.0) > 0:
        raise MtpipeError("train.compile: not supported with model.layerdrop > 0 (every draw of skipped layers "
                          "would be another graph to compile); set --no-compile")
    serve, decode = sections.get("serve"), sections.get("decode")
    if serve is None or decode is None:
        return
    # The decode section's values are the requests' defaults: they must lie within the server's limits.
    for key, value, limit in (("beam", decode.beam, serve.max_beam), ("nbest", decode.nbest, serve.max_nbest),
                              ("alpha", decode.alpha, serve.max_alpha)):
        if value > limit:
            raise MtpipeError(f"decode.{key} = {value:g} is over serve.max_{key} = {limit:g}: the default a request "
                              "gets must be one it may ask for")
    registry.check_batching(decode, serve.batching)  # continuous batching: an engine that takes requests mid-batch
    if decode.ensemble or decode.sampling_topk:  # an ensemble and sampling are mtpipe decode's
        raise MtpipeError("decode.ensemble: mtpipe serve serves one model (--ensemble '[]')" if decode.ensemble else
                          "decode.sampling_topk: mtpipe serve translates by search (--sampling-topk 0)")
    if decode.shard:  # a part of an input file: serve has none
        raise MtpipeError(f"decode.shard = {decode.shard!r}: mtpipe serve translates requests, not a file (--shard '')")


SECTIONS: dict[str, type] = {c.SECTION: c for c in (FetchConfig, BpeConfig, BucketConfig, ModelConfig, TrainConfig,
                                                     AverageConfig, DecodeConfig, ScoreConfig, ExportConfig,
                                                     ServeConfig)}
