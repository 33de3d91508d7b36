"""params.yaml's sections of the commands that use a trained model: ``decode``, ``score``, ``export`` and ``serve``
(one frozen dataclass each, as :mod:`mtpipe.config` describes; it holds the others and the rules across sections).
Light (no torch, no pyarrow).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Optional

from mtpipe import registry
from mtpipe.errors import MtpipeError
from mtpipe.sections import Section, _h


# The largest beam (decode.beam, decode.nbest, train.valid_bleu_beam, attention --beam). Translation quality stops
# improving after a beam of a few, and past a few dozen it falls (Koehn & Knowles 2017, "Six Challenges for Neural
# Machine Translation"; Stahlberg & Byrne 2019); the decoder holds beam x the batch's rows and a top-k over beam x
# vocabulary scores each step, so a beam of thousands only costs time and memory.
MAX_BEAM = 128

PRUNE_HELP = ("LayerDrop pruning (Fan et al. 2019) of the model, without fine-tuning: '' = none; 'every_other' = drop "
              "the layers at 1-based depth d with d % floor(1/p) == 0, p = the model's layerdrop; 'every_other:R' = "
              "the same with pruning rate R (0.5 = half depth); or the 0-based layers to keep, e.g. "
              "'enc:0,2,4;dec:0,2,4' (a side left out keeps every layer).")


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
        choices=registry.ENGINE_NAMES)
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
    ensemble: list = _h(
        "More checkpoints decoded with --checkpoint as one ensemble: the models' next-token probabilities averaged at "
        "each step (as fairseq and OpenNMT do); one vocabulary required. `--checkpoint A --checkpoint B` sets this "
        "to \\[B]; with DVC, list them in the decode stage's deps too. Engine mtpipe, not with compile or prune; "
        "cuda_graphs does not apply.", default_factory=list)
    sampling_topk: int = _h(
        "0: search (beam search, greedy at beam 1). K > 0: sample each token from the K most likely; -1: from the "
        "whole distribution (e.g. back-translation at scale). With beam N, N samples per sentence, the nbest best "
        "by score kept. Reproducible for a seed, and a sentence's sample does not depend on its batch.",
        default=0, ge=-1)
    sampling_topp: float = _h(
        "Sampling: draw from the smallest set of most likely tokens whose probability reaches this (nucleus "
        "sampling, after sampling_topk's cut); 1 = no cut. Needs sampling_topk != 0.", default=1.0, gt=0, le=1)
    temperature: float = _h(
        "Sampling: the log-probabilities are divided by this before the draw (< 1 sharper, > 1 flatter); scores "
        "stay the model's. Needs sampling_topk != 0.", default=1.0, gt=0)
    seed: int = _h("Sampling: the seed of the draws; a sentence's sample is a function of this and its source "
                   "tokens alone (identical source lines get the same sample).", default=1, ge=0)
    chunk_lines: int = _h(
        "--input FILE is read, translated and written this many lines at a time (length-sorted batches within a "
        "chunk, the output in input order), so that the text and translations held are bounded by this, not by the "
        "file (docs/decoding.md measures peak memory against the file's size). With --out, each "
        "finished chunk is kept beside the output (.OUT.partial) until the artifact is assembled: a killed run, "
        "rerun with the same command, resumes after its last finished chunk.", default=50_000, ge=1)
    shard: str = _h(
        "'i/n': translate only part i (0-based, as fairseq's --shard-id) of --input FILE cut into n contiguous parts "
        "whose line counts differ by at most one, so that n processes or machines share a corpus with no "
        "coordination; the parts' translations concatenated in order are the whole file's. '' = the whole file.",
        default="")

    def __post_init__(self) -> None:
        if isinstance(self.compile, bool):  # decode.compile as older params files and checkpoints record it
            object.__setattr__(self, "compile", "aot" if self.compile else "off")
        super().__post_init__()

    def check(self) -> None:
        """nbest <= beam, shard i/n, what the engines leave out (each its entry's check in :mod:`mtpipe.registry`:
        ctranslate2's, an ensemble's, sampling only by an engine that samples) and precision int8, sampling's keys
        only when sampling."""
        self.shard_part()
        if self.nbest > self.beam:
            raise MtpipeError(f"decode.nbest: {self.nbest} is not between 1 and decode.beam ({self.beam})")
        registry.check(self)  # what the engines refuse: the registry's entries, one each
        if self.compile != "off" and self.precision == "int8":
            raise MtpipeError("decode.compile: applies to precision fp32 and bf16, not int8 (its quantised linear "
                              "layers are torch.ao modules that torch.compile does not fuse)")
        for key, value in (("sampling_topp", self.sampling_topp), ("temperature", self.temperature)):
            if self.sampling_topk == 0 and value != 1.0:
                raise MtpipeError(f"decode.{key} = {value:g} applies to sampling: set decode.sampling_topk (K > 0: "
                                  "the K most likely tokens; -1: all of them)")

    def shard_part(self) -> tuple[int, int] | None:
        """decode.shard as ``(i, n)`` (part i, 0-based, of n), or None: the whole file."""
        if not self.shard:
            return None
        i, sep, n = self.shard.partition("/")
        if not (sep and all(x.isascii() and x.isdigit() for x in (i, n)) and int(i) < int(n)):
            raise MtpipeError(f"decode.shard: '{self.shard}' is not i/n with 0 <= i < n (0/4: the first of 4 parts)")
        return int(i), int(n)


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
    min_chrf: Optional[float] = _h("Gate: exit with status 3 when chrF2 is below this.", default=None)
    max_ter: Optional[float] = _h("Gate: exit with status 3 when TER is above this (lower TER is better).",
                                  default=None)
    max_drop: Optional[float] = _h("Gate: exit with status 3 when BLEU is more than this below the --baseline "
                                   "metrics JSON's BLEU.", default=None, ge=0)
    max_drop_chrf: Optional[float] = _h("Gate: exit with status 3 when chrF2 is more than this below the --baseline "
                                        "metrics JSON's chrF2.", default=None, ge=0)
    max_rise_ter: Optional[float] = _h("Gate: exit with status 3 when TER is more than this above the --baseline "
                                       "metrics JSON's TER.", default=None, ge=0)
    require_baseline: bool = _h("A baseline gate (max_drop, max_drop_chrf, max_rise_ter) without --baseline is an "
                                "error (exit 1); false: such gates are skipped with a warning (e.g. before a "
                                "baseline exists).", default=True)
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
    drain_grace_s: float = _h("Seconds after SIGTERM during which /health/ready answers 503 while requests are still "
                              "accepted and served, so that a load balancer stops sending new ones before the server "
                              "stops accepting; then the drain (drain_s). Ctrl-C (SIGINT) skips it.", default=5.0,
                              ge=0)
    request_timeout_s: float = _h("Seconds a request may take from its arrival to its answer; one not answered "
                                  "within it gets 504 and what is left of its decoding is cancelled (0: no limit).",
                                  default=60.0, ge=0)
    access_log: bool = _h("One log line per HTTP request: client, method, path, status, milliseconds, sentences "
                          "(never the request's text).", default=False)
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


# The decode settings a checkpoint records (train: the params.yaml decode keys it ran with; average and export copy
# them): ``decode`` and ``serve`` take them where neither params.yaml nor a flag sets them (README, "Decoding
# defaults"). The search's rules only: the machine's settings (precision, threads, engine) stay the decoder's own.
RECORDED_DECODE = ("beam", "alpha", "length_penalty", "max_len_a", "max_len_b")
