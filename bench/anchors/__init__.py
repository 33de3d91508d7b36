"""Side by side with the anchors, fairseq 0.12.2 and CTranslate2, one command: ``python -m bench.anchors``.

Needs the anchors' ``setup_anchors.sh`` (in ``$MTPIPE_ANCHORS``) run into ``--anchors``: Multi30k text, the joint
SentencePiece 8k model, fairseq's binarised data, ``venv-fs38`` (fairseq, torch 1.13.1), ``venv-ct2``. Every
measurement in its own process with 2 threads, the same allocator settings and ``MKL_DEBUG_CPU_TYPE=5`` for every
system, the parts interleaved in rounds (train, decode, data; again ...): only ratios within a round compare.

* **train** (:mod:`.train`): source+target tokens/s, fairseq-train (fp32, its dims checked in its log) against
  ``bench.train_step.make_train_step`` in fp32 and bf16 (where native) on ``mtpipe bucket``'s batches, the median
  interval after the first, small and base dims. Targets: fp32 >= 1.5x fairseq, bf16 >= 3x.
* **decode** (:mod:`.decode`): the same weights (fairseq's anchor model: fairseq, mtpipe after ``mtpipe import``,
  CTranslate2 after ``mtpipe export``; mtpipe's model: mtpipe and CTranslate2), the same search (beam 4, stop once 4
  finished, |Y|^0.6, max length source + 50, min length 1), the same 8,000-token batches and a warm-up for every
  system, outputs counted equal to fairseq's; mtpipe fp32, bf16 (native), int8, ``--decode-compile``,
  ``--decode-processes N`` against CTranslate2's N replicas. Targets: mtpipe fp32 >= 1.0x CTranslate2 fp32, best
  mode >= 1.0x CTranslate2's best, >= 3x fairseq.
* **data** (:mod:`.data`): ``fairseq-preprocess`` on the encoded text against ``mtpipe bpe`` (the raw text) +
  ``mtpipe bucket``, at Multi30k size and ``--data-pairs`` (4.5M: WMT14's), with each side's peak memory. Target >= 3x.
* ``--quality-run DIR`` (:mod:`.quality`): fairseq trained for an existing ``mtpipe train`` run's minutes with its
  settings (its ``linear`` schedule through :mod:`.fs_budget`), both sides' checkpoint average and alpha picked on
  valid, sacreBLEU on test. Target: mtpipe >= fairseq + 1 BLEU.

``--isa avx2`` restricts every library to AVX2 (the probe in the results shows it took). Logs under ``--out``.
"""
