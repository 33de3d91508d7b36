"""params.yaml's sections: one frozen dataclass each, with every rule its values must follow, however it is built.

A key's own rules (type, range, choices) are its field's (:func:`_h`); rules across keys of a section, its
:meth:`Section.check`; rules across sections, :func:`check_sections`. Each field is also a flag of the commands that
read its section, so ``dvc.yaml`` passes paths only. :mod:`mtpipe.params` layers params.yaml and flags into sections.
Light (no torch, no pyarrow): the CLI builds its options from these classes at start-up.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from mtpipe.errors import MtpipeError


def _h(text: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
       lt: float | None = None, choices: tuple[str, ...] | None = None, **kw: Any) -> Any:
    """A dataclass field with a help string (``mtpipe <stage> --help``) and the rules its value must follow when a
    section is built (:class:`Section`): a finite number ``>= ge``, ``> gt``, ``<= le``, ``< lt``; one of
    ``choices``. ``None`` (for optional fields) passes every rule."""
    rules = {"ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices}
    return field(metadata={"help": text, **{k: v for k, v in rules.items() if v is not None}}, **kw)


class Section:
    """Base of every params section: the fields' rules, then :meth:`check`'s, hold however a section is built."""

    SECTION: typing.ClassVar[str]

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            check_rules(type(self), f.name, getattr(self, f.name), f.metadata, "params")
        self.check()

    def check(self) -> None:
        """The rules across this section's keys (an :class:`MtpipeError` naming them); none here."""


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

    def check(self) -> None:
        if self.src_lang == self.tgt_lang:
            raise MtpipeError(f"fetch.src_lang and fetch.tgt_lang are both '{self.src_lang}'")
        if self.max_len < max(self.min_len, 1):
            raise MtpipeError(f"fetch.min_len={self.min_len} / fetch.max_len={self.max_len}: need 0 <= min_len <= "
                              "max_len")


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

    def check(self) -> None:
        if self.vocab_size <= SPECIAL_TOKENS:
            raise MtpipeError(f"bpe.vocab_size={self.vocab_size}: must be larger than the {SPECIAL_TOKENS} special "
                              "tokens")
        if (self.dropout > 0) != (self.dropout_copies > 0):
            raise MtpipeError(f"bpe.dropout={self.dropout} with bpe.dropout_copies={self.dropout_copies}: BPE-dropout "
                              "needs both (a probability > 0 and at least one extra copy of train), or neither")


SPECIAL_TOKENS = 4  # pad, unk, bos, eos: the first ids of every vocabulary (mtpipe.artifacts.SPECIALS)


@dataclass(frozen=True)
class BucketConfig(Section):
    """``bucket``: token-based batching (paper section 5.1: ~25k source + ~25k target tokens per step)."""

    SECTION: typing.ClassVar[str] = "bucket"

    max_tokens: int = _h("Per-batch cap on padded tokens per side (one GPU / process).", default=4096, ge=1)
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


# The largest beam (decode.beam, decode.nbest, train.valid_bleu_beam, attention --beam). Translation quality stops
# improving after a beam of a few, and past a few dozen it falls (Koehn & Knowles 2017, "Six Challenges for Neural
# Machine Translation"; Stahlberg & Byrne 2019); the decoder holds beam x the batch's rows and a top-k over beam x
# vocabulary scores each step, so a beam of thousands only costs time and memory.
MAX_BEAM = 128


@dataclass(frozen=True)
class TrainConfig(Section):
    """``train``: optimisation (paper section 5.3-5.4), precision, stopping and checkpointing."""

    SECTION: typing.ClassVar[str] = "train"

    seed: int = _h("Random seed (model init, dropout, batch order).", default=1, ge=0)
    nproc: str = _h("Processes for the torchrun launcher: 'auto' (every visible GPU, else 1 CPU process) or a number.",
                    default="auto")
    tokens_per_update: int = _h("Target tokens per optimizer step across all processes (paper ~25000); sets "
                                "gradient accumulation.", default=25000, ge=1)
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
    precision: str = _h("fp32, bf16 (autocast, GPU and CPU), fp16 (GPU, grad scaler) or auto.", default="auto",
                        choices=("auto", "fp32", "bf16", "fp16"))
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



PRUNE_HELP = ("LayerDrop pruning (Fan et al. 2019) of the model, without fine-tuning: '' = none; 'every_other' = drop "
              "the layers at 1-based depth d with d % floor(1/p) == 0, p = the model's layerdrop; 'every_other:R' = "
              "the same with pruning rate R (0.5 = half depth); or the 0-based layers to keep, e.g. "
              "'enc:0,2,4;dec:0,2,4' (a side left out keeps every layer).")


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


@dataclass(frozen=True)
class DecodeConfig(Section):
    """``decode``: beam search (paper section 6.1: beam 4, alpha 0.6, max length input + 50)."""

    SECTION: typing.ClassVar[str] = "decode"

    beam: int = _h(f"Beam size (1 = greedy search, exactly; at most {MAX_BEAM}: BLEU stops improving after a beam of "
                   "a few and drops past a few dozen, while time and memory grow with the beam).", default=4, ge=1,
                   le=MAX_BEAM)
    alpha: float = _h("Length penalty alpha (0 = rank by log-probability alone).", default=0.6, ge=0)
    length_penalty: str = _h("'gnmt': ((5+|Y|)/6)^alpha (tensor2tensor, the paper); 'fairseq': |Y|^alpha.",
                             default="gnmt", choices=("gnmt", "fairseq"))
    max_len_a: float = _h("Max output length (pieces before EOS) = a * source pieces (without EOS) + b: this is a.",
                          default=1.0, ge=0)
    max_len_b: int = _h("Max output length (pieces before EOS) = a * source pieces (without EOS) + b: this is b.",
                        default=50, ge=0)
    split: str = _h("Split of the bpe artifact to translate.", default="test")
    max_tokens: int = _h("Padded source tokens (EOS included) per decoding batch; the decoder holds beam x this.",
                         default=8000, ge=1)
    nbest: int = _h("Hypotheses kept per sentence in the Parquet output (1 <= nbest <= beam).", default=1, ge=1,
                    le=MAX_BEAM)
    precision: str = _h("fp32, bf16 (autocast, CPU and GPU) or int8 (CPU: every linear layer and the output "
                        "projection with int8 weights, activations quantised on the fly).", default="fp32",
                        choices=("fp32", "bf16", "int8"))
    threads: int = _h("CPU threads (0 = torch's default; with processes > 1: per process, 0 = the CPUs split "
                      "evenly).", default=0, ge=0)
    processes: int = _h("Decoding processes for a file or split, each with its own copy of the model, each decoding "
                        "its own batches (CTranslate2's inter_threads): a decoding step's small products use several "
                        "cores better side by side than split; on a machine with several GPUs process i decodes on "
                        "GPU i mod their number. 1 = this process. Stdin is translated in one process; mtpipe serve "
                        "has serve.workers.", default=1, ge=1)
    prune: str = _h(PRUNE_HELP, default="")
    engine: str = _h(
        "mtpipe (this package's beam search) or ctranslate2 (CTranslate2, `pip install 'mtpipe\\[ctranslate2]'`). "
        "With ctranslate2, --checkpoint is a CTranslate2 export (`mtpipe export`; decoded as is, and with --input "
        "its own spm.model is used unless --tokens is given) or an mtpipe checkpoint (exported to float32 in a "
        "temporary directory first). Beam, alpha, both length penalties, max_len_a/b, nbest and max_tokens are "
        "honoured, scores use mtpipe's formula, greedy output is mtpipe's. At beam > 1 the search differs: "
        "CTranslate2 stops a sentence once beam x patience hypotheses have finished (fairseq's rule, = stop "
        "finished), mtpipe by decode.stop; CTranslate2's own penalty is |Y|^alpha (= fairseq), "
        "so gnmt is applied by re-ranking the hypotheses CTranslate2 finished.", default="mtpipe",
        choices=("mtpipe", "ctranslate2"))
    ct2_compute_type: str = _h(
        "engine ctranslate2: CTranslate2 compute type: default (the export's weight type), auto, float32, int8, "
        "int8_float32, int8_float16, int8_bfloat16, int16, float16, bfloat16 (precision applies to engine mtpipe "
        "only).", default="default",
        # CTranslate2's compute types (ctranslate2.Translator(compute_type=...)); "default" keeps the weights' type.
        choices=("default", "auto", "float32", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16",
                 "float16", "bfloat16"))
    stop: str = _h(
        "When a sentence's beam search stops: 'bound' (exact: when no live hypothesis can beat the finished ones; "
        "tensor2tensor's rule, the paper's) or 'finished' (fairseq's and CTranslate2's search: the live beam is "
        "refilled from 2 x beam candidates and a sentence stops once round(beam x patience) hypotheses have "
        "finished; fewer decoder steps, may miss a longer, better hypothesis). Engine ctranslate2 always stops by "
        "'finished'.", default="bound", choices=("bound", "finished"))
    patience: float = _h(
        "stop=finished, and engine ctranslate2 always: stop a sentence once round(beam x this) hypotheses have "
        "finished (1 = fairseq's and CTranslate2's default; 2 finds the exact search's best output more often, at "
        "some cost in speed).", default=1.0, ge=1)
    min_len: int = _h(
        "Fewest pieces before EOS: 0 lets an empty output finish (the paper's search); 1 never ends a hypothesis at "
        "the first step, as fairseq (--min-len 1) and CTranslate2 (min_decoding_length 1) do by default: set 1 to "
        "decode exactly as they do.", default=0, ge=0)
    device: str = _h(
        "Where to decode: auto (the GPU when one is visible, else the CPU; the CPU for int8, which runs there only), "
        "cpu or cuda. On a GPU a step of a few sentences is bound by launching its kernels (decode.cuda_graphs "
        "launches them at once): a server with few clients on a machine with a GPU may answer as soon with cpu.",
        default="auto", choices=("auto", "cpu", "cuda"))
    compile: str = field(default="off", metadata={
        "help": "Engine mtpipe, fp32 or bf16: run the decoder's step compiled (fused kernels, fewer operations; on "
        "CPU float32 weights frozen into the graph, packed once for oneDNN), at the cost of building it first (tens "
        "of seconds on a small CPU; needs a C++ compiler on CPU). off: the eager step; jit: torch.compile, built in "
        "every process; aot: float32 on CPU built ahead of time once and kept in decode.package_cache, loaded in "
        "seconds by later runs; elsewhere as jit. false / true (older params files and checkpoints): off / aot; the "
        "flag alone: aot. Outputs equal the uncompiled step's up to float rounding.",
        "choices": ("off", "jit", "aot"), "booleans": ("off", "aot")})
    package_cache: str = _h("Where decode.compile=aot keeps its packages ('': ~/.cache/mtpipe, or $XDG_CACHE_HOME/"
                            "mtpipe); $MTPIPE_CACHE_DIR overrides it. Deleting it is safe.", default="")
    package_cache_gb: float = _h("The packages' size at most (GB), the least recently used removed beyond it; "
                                 "$MTPIPE_CACHE_MAX_GB overrides it.", ge=0, default=5.0)
    cuda_graphs: bool = _h(
        "Engine mtpipe on a GPU, fp32 or bf16: replay the decoder's step (layers, projection, log-softmax) from CUDA "
        "graphs recorded for a few fixed shapes (rows, cached and source positions rounded up to powers of two), "
        "for batches of up to 256 rows: a few sentences' step is bound by launching its ~200 kernels, which a "
        "graph launches at once. No effect on CPU, with decode.compile (its step runs instead) or with restricted "
        "self-attention. Outputs equal the eager step's up to float rounding. Where a graph cannot be made (GPU "
        "memory, a driver that does not allow it): one warning, then the eager step.", default=True)

    def __post_init__(self) -> None:
        if isinstance(self.compile, bool):  # decode.compile as older params files and checkpoints record it
            object.__setattr__(self, "compile", "aot" if self.compile else "off")
        super().__post_init__()

    def check(self) -> None:
        """nbest <= beam, and what engine ctranslate2 and precision int8 leave out."""
        if self.nbest > self.beam:
            raise MtpipeError(f"decode.nbest: {self.nbest} is not between 1 and decode.beam ({self.beam})")
        if self.engine == "ctranslate2":
            if self.precision != "fp32":
                raise MtpipeError(f"decode.precision: {self.precision} applies to engine mtpipe; with engine "
                                  "ctranslate2 set decode.ct2_compute_type (e.g. bfloat16, int8)")
            if self.prune:
                raise MtpipeError("decode.prune: not available with engine ctranslate2; write a pruned checkpoint "
                                  "with `mtpipe average --prune` and decode (or export) that")
            if self.compile != "off":
                raise MtpipeError("decode.compile: applies to engine mtpipe (CTranslate2 runs its own compiled code)")
        elif self.compile != "off" and self.precision == "int8":
            raise MtpipeError("decode.compile: applies to precision fp32 and bf16, not int8 (its quantised linear "
                              "layers are torch.ao modules that torch.compile does not fuse)")


@dataclass(frozen=True)
class ScoreConfig(Section):
    """``score``: sacreBLEU metrics and the CI regression gate."""

    SECTION: typing.ClassVar[str] = "score"

    tokenize: str = _h("sacreBLEU tokenizer (13a is the WMT standard).", default="13a")
    lowercase: bool = _h("Case-insensitive BLEU.", default=False)
    split: Optional[str] = _h("Reference split of the fetch artifact (--ref DIR) when --hyp is a text file (default: "
                              "test). With a hypotheses artifact its own split is used; a different value here is an "
                              "error.", default=None)
    min_bleu: Optional[float] = _h("Gate: exit with status 3 when BLEU is below this (the metrics JSON is still "
                                   "written).", default=None)
    max_drop: Optional[float] = _h("Gate: exit with status 3 when BLEU is more than this below the --baseline "
                                   "metrics JSON's BLEU.", default=None, ge=0)
    paper_bleu: bool = _h("Also report the paper's tokenised, compound-split BLEU (not comparable to sacreBLEU).",
                          default=False)


@dataclass(frozen=True)
class ExportConfig(Section):
    """``export``: a checkpoint as a model for another inference engine."""

    SECTION: typing.ClassVar[str] = "export"

    format: str = _h("ctranslate2 (a CTranslate2 model directory; needs the optional ctranslate2 package), marian "
                     "(a Hugging Face MarianMTModel directory: post-norm models), pegasus (a Hugging Face "
                     "PegasusForConditionalGeneration directory: pre-norm models) or huggingface (marian for a "
                     "post-norm model, pegasus for a pre-norm one); the Hugging Face formats need the optional "
                     "transformers package.",
                     default="ctranslate2", choices=("ctranslate2", "marian", "pegasus", "huggingface"))
    # CTranslate2's weight types (ctranslate2.specs.model_spec.ACCEPTED_MODEL_TYPES), plus "none" = keep float32.
    quantization: str = _h("CTranslate2 weight type: none (float32), int8, int8_float32, int8_float16, int8_bfloat16, "
                           "int16, float16, bfloat16 or float32.", default="none",
                           choices=("none", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16",
                                    "float16", "bfloat16", "float32"))

    def check(self) -> None:
        if self.format != "ctranslate2" and self.quantization != "none":
            raise MtpipeError(f"export.quantization: {self.quantization!r} applies to CTranslate2 only; use 'none' "
                              f"with format {self.format}")



@dataclass(frozen=True)
class ServeConfig(Section):
    """``serve``: the HTTP translation server (``mtpipe serve``); decoding settings come from ``decode``.

    Key names differ from ``decode``'s: both sections are flags of the one command."""

    SECTION: typing.ClassVar[str] = "serve"

    host: str = _h("Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface).",
                   default="127.0.0.1")
    port: int = _h("TCP port (0 = any free port; the one taken is printed).", default=8080, ge=0, le=65535)
    max_sentences: int = _h("Most sentences in one request (more: 413).", default=64, ge=1)
    max_chars: int = _h("Most characters in one sentence (more: 413).", default=1000, ge=1)
    max_queue: int = _h("Most requests waiting for a decoding batch (more: 503 with Retry-After).", default=64, ge=1)
    batch_wait_ms: float = _h("How long a request that finds its worker idle waits for concurrent ones to start "
                              "decoding with it (milliseconds). A busy worker takes new requests into its running "
                              "batch at the next decoder step (continuous batching, mtpipe engine).",
                              default=5.0, ge=0)
    batch_tokens: int = _h("Source tokens (EOS included) a worker decodes at once: waiting requests join while the "
                           "ones in flight hold fewer (a larger request is decoded alone); decode.max_tokens still "
                           "bounds each batch.", default=8000, ge=1)
    batching: str = _h("How a worker decodes the requests it takes: 'batch' (each batch to its end, sorted by "
                       "length) or 'continuous' (mtpipe engine: requests join the running batch at the next decoder "
                       "step and are answered the step they end).", default="batch", choices=("batch", "continuous"))
    workers: int = _h("Decoding processes, each with its own copy of the model and 1/N of the CPU threads (unless "
                      "decode.threads is set), each decoding its own requests: the small batches of a server use "
                      "several cores better side by side than split; with several GPUs worker i decodes on GPU i "
                      "mod their number. 1 = the model in the server's own process.", default=1, ge=1)
    max_beam: int = _h("Largest beam a request may ask for (decode.beam is the default; at most decode.beam's own "
                       "limit).", default=8, ge=1, le=MAX_BEAM)
    max_nbest: int = _h("Largest nbest a request may ask for (decode.nbest is the default).", default=4, ge=1,
                        le=MAX_BEAM)
    max_alpha: float = _h("Largest length-penalty alpha a request may ask for (decode.alpha is the default).",
                          default=4.0, ge=0)
    keep_alive_s: float = _h("How long an idle client connection stays open for its next request (seconds). Behind "
                             "a proxy or load balancer that reuses its connections to the server, set it above the "
                             "proxy's idle timeout (e.g. 75 for a 60-second one): else a request the proxy sends as "
                             "the server closes the connection is reset.", default=5.0, gt=0)
    read_timeout_s: float = _h("Seconds a client has to send a whole request, headers and body, counted from its "
                               "first byte (from the connection's opening for its first request); then the "
                               "connection is closed, with a 408 if part of a request came. Bounds silent and slow "
                               "clients, which keep_alive_s (after a response) does not.", default=30.0, gt=0)
    max_connections: int = _h("Most client connections open at once; one more is answered 503 and closed at once, "
                              "so that idle clients cannot use up the process's open files (checked against its "
                              "limit, ulimit -n, at start-up).", default=1000, ge=1)
    drain_s: float = _h("Seconds SIGTERM (or Ctrl-C) waits for the requests in flight; then those still waiting or "
                        "decoding are answered 503, connections still sending a request are closed, and the process "
                        "exits 0.", default=30.0, ge=0)
    max_request_work: int = _h("Most decoding work one request may ask for: its source tokens (EOS included) x its "
                               "beam, summed over its sentences (more: 413). Bounds how long one request keeps a "
                               "worker busy, which max_sentences x max_chars do not (64 sentences of 1,000 "
                               "characters at beam 8 are ~128,000).", default=20000, ge=1)
    chunk_work: int = _h("Work (source tokens x beam) a worker takes from one request at a time: a larger request "
                         "is decoded in chunks of about this much, and the waiting requests take turns chunk by "
                         "chunk, the least served first, so a short request waits for a chunk, not for a large "
                         "request. Smaller: shorter waits behind large requests; larger: fuller batches.",
                         default=2000, ge=1)
    max_output_tokens: int = _h("Most tokens decoded for one sentence (decode.max_len_a / max_len_b and the "
                                "model's positions still apply when lower): bounds the work of a runaway output.",
                                default=400, ge=1)


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
    if serve.batching == "continuous" and decode.engine != "mtpipe":
        raise MtpipeError(f"serve.batching=continuous needs decode.engine=mtpipe ({decode.engine} decodes batch by "
                          "batch)")


# The decode settings a checkpoint records (train: the params.yaml decode keys it ran with; average and export copy
# them): ``decode`` and ``serve`` take them where neither params.yaml nor a flag sets them (README, "Decoding
# defaults"). The search's rules only: the machine's settings (precision, threads, engine) stay the decoder's own.
RECORDED_DECODE = ("beam", "alpha", "length_penalty", "max_len_a", "max_len_b")

SECTIONS: dict[str, type] = {c.SECTION: c for c in (FetchConfig, BpeConfig, BucketConfig, ModelConfig, TrainConfig,
                                                     AverageConfig, DecodeConfig, ScoreConfig, ExportConfig,
                                                     ServeConfig)}


def check_rules(cls: type, key: str, value: Any, meta: Any, where: str) -> None:
    """A value against its field's bounds and ``choices`` (see :func:`_h`); ``where`` names its origin."""
    if value is None:
        return
    name = f"{cls.SECTION}.{key}"
    bounds = [(op, meta[op]) for op in ("ge", "gt", "le", "lt") if op in meta]
    if bounds and not (math.isfinite(value) and all(_BOUND[op](value, b) for op, b in bounds)):
        want = " and ".join(f"{_SYMBOL[op]} {b:g}" for op, b in bounds)
        raise MtpipeError(f"{where}: {name} = {value!r} must be {want}")
    if "choices" in meta and value not in meta["choices"]:
        raise MtpipeError(f"{where}: {name} = {value!r} is not one of {', '.join(meta['choices'])}")


_BOUND = {"ge": lambda v, b: v >= b, "gt": lambda v, b: v > b, "le": lambda v, b: v <= b, "lt": lambda v, b: v < b}
_SYMBOL = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def to_dict(section: Any) -> dict[str, Any]:
    """A section as plain data (for manifests and checkpoints)."""
    return dataclasses.asdict(section)

