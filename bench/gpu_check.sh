#!/bin/bash
# mtpipe's GPU paths in one short run: bf16 training, average, beam search in fp32 and bf16 (sentences/s, sacreBLEU),
# `mtpipe serve` against offline decoding with one and two decoding processes (bench/serve.py; needs fastapi and
# uvicorn), decode.processes 2, a server's few-sentence step against a full batch with and without CUDA graphs
# (bench/decode_speed.py), fp16 training, torch.compile, exact resume (N updates against N/2 then resumed, under
# torch.use_deterministic_algorithms with CUBLAS_WORKSPACE_CONFIG=:4096:8; then with torch's default algorithms, as
# information: on a GPU attention's backward accumulates in an order that varies, so those may differ without a bug).
# First a preflight (bench/machine.py --preflight): one line for each thing the image lacks (a C compiler, Python's
# headers, Triton, safetensors, xxhash, fastapi / uvicorn, a torch new enough); only the parts needing it are skipped.
# Then the paper's shapes on synthetic WMT-shaped batches (bench/gpu_paper.py: base and big, bf16, eager and compiled:
# tokens/s, MFU, GPU busy, launches and syncs, memory; checkpoints, bitwise resume, beam-4 decoding of 3,003 sources),
# within PAPER_BUDGET seconds (default 540; 0 skips it).
#
#   bash bench/gpu_check.sh ARTIFACTS [UPDATES] [MINUTES]
#
# ARTIFACTS: `make pipeline`'s fetch, bpe and bucket; UPDATES (default 8500): train.max_steps; MINUTES (default 0 =
# none): train.max_time. Settings from ./params.yaml. Logs and results under $OUT, work files under $W.
set -u
ART=${1:?usage: bash bench/gpu_check.sh ARTIFACTS [UPDATES] [MINUTES]}
STEPS=${2:-8500}
MINUTES=${3:-0}
SHORT=${SHORT:-300}  # updates of the fp16, compile and resume checks
PAPER_BUDGET=${PAPER_BUDGET:-540}  # seconds of bench/gpu_paper.py (0: skip it)
PY=${PY:-python3}
OUT=${OUT:-bench/out/gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}
W=${W:-$(mktemp -d)}
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 COLUMNS=150
M="$PY -m mtpipe"
T0=$(date +%s)
el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
stats() { grep -E "│ (sentences/s|seconds) " "$1" | tr -s ' │' ' '; }
train() { $M train --tokens "$ART/bpe" --batches "$ART/bucket" "$@"; }
# `mtpipe train` under torch.use_deterministic_algorithms(True), with cuBLAS's deterministic workspace (one process)
DET=(env "CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}" $PY -c "import torch
torch.use_deterministic_algorithms(True)
from mtpipe.cli import app
app(prog_name='mtpipe')")
train_det() { "${DET[@]}" train --tokens "$ART/bpe" --batches "$ART/bucket" --nproc 1 "$@"; }
lacks() { local k; for k; do case " $MISSING " in *" $k "*) return 0;; esac; done; return 1; }  # preflight's keys

el "machine"
nvidia-smi -L 2>&1 | head -2
$PY bench/machine.py
el "preflight: what this image lacks (nothing listed: nothing)"
MISSING=$($PY bench/machine.py --preflight cuda)

if [ "$PAPER_BUDGET" != 0 ]; then
  el "the paper's shapes, synthetic batches, within $PAPER_BUDGET s (bench/gpu_paper.py)"
  $PY bench/gpu_paper.py --device cuda --budget-s "$PAPER_BUDGET" --work "$W/paper" --results "$OUT/gpu_paper.json" \
    > "$OUT/gpu_paper.log" 2>&1; echo "rc=$?"
  grep -E "^\[\+ *[0-9]+s\] (versions|train|checkpoint|resume|decode)|^against|^  (eager|compiled) |^done" "$OUT/gpu_paper.log" | cut -c1-400
fi
if lacks safetensors; then  # every part below trains, so writes checkpoints
  el "skipped: training, averaging, decoding, serving, fp16, resume and compile (they need safetensors: see the preflight)"
  el "done: logs in $OUT"
  exit 0
fi

el "train: $STEPS updates (time cap: $MINUTES min), train.precision from params.yaml"
train --out "$W/train" --max-steps "$STEPS" --max-time "$MINUTES" > "$OUT/train.log" 2>&1; echo "rc=$?"
grep -E "│ (steps|stopped by|training time|target tokens/s|precision / device|valid ppl) " "$OUT/train.log" | tr -s ' │' ' '
grep -E "^step [0-9,]+ " "$OUT/train.log" | tail -3

el "average"
$M average --run "$W/train" --out "$W/average" > "$OUT/average.log" 2>&1; echo "rc=$?"

for split in valid test; do
  for prec in fp32 bf16; do
    $M decode --checkpoint "$W/average" --tokens "$ART/bpe" --split $split --precision $prec --out "$W/dec-$split-$prec" \
      > "$OUT/decode-$split-$prec.log" 2>&1; rc=$?
    $M score --hyp "$W/dec-$split-$prec" --ref "$ART/fetch" --split $split --out "$OUT/score-$split-$prec.json" \
      > /dev/null 2>&1
    bleu=$($PY -c "import json; print(round(json.load(open('$OUT/score-$split-$prec.json'))['bleu'], 2))" 2>&1)
    el "decode $split $prec rc=$rc: $(stats "$OUT/decode-$split-$prec.log" | tr '\n' ' ') BLEU $bleu"
  done
done

$PY -c "import pyarrow.parquet as pq; t = pq.read_table('$ART/fetch/test.parquet')
for column, name in (('src', 'src'), ('tgt', 'ref')): open('$W/test.' + name, 'w').write('\n'.join(t[column].to_pylist()) + '\n')"
if lacks fastapi uvicorn; then
  el "serve: skipped (bench/serve.py needs fastapi and uvicorn: see the preflight)"
else
  el "serve: 8 clients, the test sentences one per request, against offline decode (fp32, 2 rounds)"
  $PY bench/serve.py --checkpoint "$W/average" --tokens "$ART/bpe" --sentences "$W/test.src" --clients 8 --rounds 2 \
    --out "$OUT/serve" > "$OUT/serve.log" 2>&1; echo "rc=$?"
  grep -E "^(round|server / offline)" "$OUT/serve.log"
  el "serve again with 2 decoding processes (serve.workers 2: one GPU shared, or one GPU each)"
  $PY bench/serve.py --checkpoint "$W/average" --tokens "$ART/bpe" --sentences "$W/test.src" --clients 8 --rounds 2 \
    --serve-args="--workers 2" --out "$OUT/serve_w2" > "$OUT/serve_w2.log" 2>&1; echo "rc=$?"
  grep -E "^(round|server / offline)" "$OUT/serve_w2.log"
fi
el "decode with 2 processes (decode.processes 2)"
$M decode --checkpoint "$W/average" --tokens "$ART/bpe" --split test --processes 2 --stats > "$W/p2.txt" \
  2> "$OUT/decode-test-p2.log"; echo "rc=$? decode.processes 2: $(stats "$OUT/decode-test-p2.log" | tr '\n' ' ')"

el "one search step: ~8-sentence batches (a server's at 8 clients) against 8,000-token batches, fp32, with and \
without CUDA graphs; then a profile of the small batches"
DS=($PY bench/decode_speed.py --checkpoint "$W/average" --tokens "$ART/bpe" --source "$W/test.src" --reference \
  "$W/test.ref" --device cuda --no-naive --precisions fp32 --rounds 2)
"${DS[@]}" --batches 8000,130 --plain cuda-graphs --results "$OUT/step.json" > "$OUT/step.log" 2>&1; echo "rc=$?"
grep -E "^│" "$OUT/step.log"
"${DS[@]}" --batches 130 --sentences 48 --profile > "$OUT/step_profile.log" 2>&1; echo "rc=$?"
grep -E "cudaLaunchKernel|cudaGraphLaunch|Self (CPU|CUDA) time total" "$OUT/step_profile.log"

el "fp16 + grad scaler, $SHORT updates"
train --out "$W/fp16" --max-steps "$SHORT" --max-time 0 --precision fp16 > "$OUT/fp16.log" 2>&1; echo "rc=$?"
grep -E "│ (valid ppl|target tokens/s|precision / device) " "$OUT/fp16.log" | tr -s ' │' ' '

R=(--max-time 0 --precision fp32 --schedule inverse_sqrt --save-every-steps 50 --save-every-progress 0 --nproc 1)
resume() {  # $1: the runs' name (their directories and logs); the rest: the command that trains
  local name=$1; shift
  "$@" "${R[@]}" --out "$W/$name-one" --max-steps "$SHORT" > "$OUT/$name-one.log" 2>&1; echo "rc=$?"
  "$@" "${R[@]}" --out "$W/$name-two" --max-steps $(( SHORT / 2 )) > "$OUT/$name-two.log" 2>&1; echo "rc=$?"
  "$@" "${R[@]}" --out "$W/$name-two" --max-steps "$SHORT" >> "$OUT/$name-two.log" 2>&1; echo "rc=$?"
  $PY - "$W/$name" "$SHORT" <<'EOF'
import sys
from safetensors.torch import load_file
w, n = sys.argv[1], int(sys.argv[2])
a, b = (load_file(f"{w}-{r}/checkpoints/step_{n:08d}/model.safetensors") for r in ("one", "two"))
print("  bitwise equal", all(bool((a[k] == b[k]).all()) for k in a),
      "max |diff|", max(float((a[k].float() - b[k].float()).abs().max()) for k in a))
EOF
}
el "resume: $SHORT updates in one go against $(( SHORT / 2 )) then resumed (fp32, inverse_sqrt: lr by step only), \
deterministic: torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"
resume resume-det train_det
el "resume again with torch's default algorithms (information: what mtpipe train runs; on a GPU attention's backward \
accumulates in an order that varies, so a difference here is not a resume bug)"
resume resume train

if lacks compiler headers triton; then
  el "torch.compile: skipped (it needs a C compiler, Python's headers and Triton: see the preflight)"
else
  el "torch.compile, $SHORT updates"
  train --out "$W/compile" --max-steps "$SHORT" --max-time 0 --compile > "$OUT/compile.log" 2>&1; echo "rc=$?"
  grep -E "│ (training time|target tokens/s|precision / device) " "$OUT/compile.log" | tr -s ' │' ' '
fi
el "done: logs in $OUT"
