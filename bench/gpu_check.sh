#!/bin/bash
# mtpipe's GPU paths in one short run on the visible GPU: bf16 training and its throughput, average, beam-search
# decoding in fp32 and bf16 (sentences/s and sacreBLEU on valid and test), `mtpipe serve` under 8 concurrent clients
# against offline decoding, with one decoding process and with two (bench/serve.py; needs the serve extra: fastapi,
# uvicorn), decoding with decode.processes 2, a search step's cost for a
# server's few sentences against a full batch, each with and without decode.cuda_graphs (bench/step_cost.py), fp16
# training with the grad scaler, torch.compile, and exact resume (one run of N updates against N/2 then resumed; the
# weights compared bitwise).
#
#   bash bench/gpu_check.sh ARTIFACTS [UPDATES] [MINUTES]
#
# ARTIFACTS: a directory with the quickstart's fetch, bpe and bucket artifacts (`make pipeline`, or the three stages);
# UPDATES (default 8500): the main run's train.max_steps, its schedule's end; MINUTES (default 0 = none): a time cap
# (train.max_time) that ends the run, and its schedule, first. Model and training settings come from ./params.yaml.
# Writes every log and score under $OUT (default bench/out/gpu-check-<UTC time>); work files under $W (default a
# temporary directory). Needs a CUDA GPU: on a CPU the fp16 step fails by design and the rest runs slowly.
set -u
ART=${1:?usage: bash bench/gpu_check.sh ARTIFACTS [UPDATES] [MINUTES]}
STEPS=${2:-8500}
MINUTES=${3:-0}
SHORT=${SHORT:-300}  # updates of the fp16, compile and resume checks
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

el "machine"
nvidia-smi -L 2>&1 | head -2
$PY -c "import sys, torch; c = torch.cuda.is_available(); print('python', sys.version.split()[0], 'torch', torch.__version__, 'gpu', c and torch.cuda.get_device_name(), 'bf16', c and torch.cuda.is_bf16_supported())"
grep -m1 'model name' /proc/cpuinfo; echo "cpu flags: $(grep -m1 -o 'avx512_bf16\|amx_bf16\|avx512f\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')cores $(nproc)"

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

el "serve: 8 clients, the test sentences one per request, against offline decode (fp32, 2 rounds)"
$PY -c "import pyarrow.parquet as pq; print('\\n'.join(pq.read_table('$ART/fetch/test.parquet').column('src').to_pylist()))" \
  > "$W/test.src"
$PY bench/serve.py --checkpoint "$W/average" --tokens "$ART/bpe" --sentences "$W/test.src" --clients 8 --rounds 2 \
  --out "$OUT/serve" > "$OUT/serve.log" 2>&1; echo "rc=$?"
grep -E "^(round|server / offline)" "$OUT/serve.log"
el "serve again with 2 decoding processes (serve.workers 2: one GPU shared, or one GPU each), and decode with 2"
$PY bench/serve.py --checkpoint "$W/average" --tokens "$ART/bpe" --sentences "$W/test.src" --clients 8 --rounds 2 \
  --serve-args="--workers 2" --out "$OUT/serve_w2" > "$OUT/serve_w2.log" 2>&1; echo "rc=$?"
grep -E "^(round|server / offline)" "$OUT/serve_w2.log"
$M decode --checkpoint "$W/average" --tokens "$ART/bpe" --split test --processes 2 --stats > "$W/p2.txt" \
  2> "$OUT/decode-test-p2.log"; echo "rc=$? decode.processes 2: $(stats "$OUT/decode-test-p2.log" | tr '\n' ' ')"

el "one search step: ~8-sentence batches (a server's at 8 clients) against 8,000-token batches, fp32, + profile"
$PY bench/step_cost.py --checkpoint "$W/average" --tokens "$ART/bpe" --sentences "$W/test.src" --device cuda \
  --rounds 2 --cuda-graphs both --profile > "$OUT/step_cost.log" 2>&1; echo "rc=$?"
grep -E "│ (full|small)|small / full|graphs / eager|buckets|cudaLaunchKernel|cudaGraphLaunch|Self (CPU|CUDA) time total" \
  "$OUT/step_cost.log"
el "the same with graphs for up to 1,024 rows (the default: 256), and with 32,000-token full batches: the next defaults?"
$PY bench/step_cost.py --checkpoint "$W/average" --tokens "$ART/bpe" --sentences "$W/test.src" --device cuda \
  --rounds 2 --cuda-graphs both --graph-rows 1024 > "$OUT/step_cost_1024.log" 2>&1; echo "rc=$?"
grep -E "│ (full|small)|graphs / eager|buckets" "$OUT/step_cost_1024.log"
$PY bench/step_cost.py --checkpoint "$W/average" --tokens "$ART/bpe" --sentences "$W/test.src" --device cuda \
  --rounds 2 --cuda-graphs on --max-tokens 32000 --small-tokens 8000 > "$OUT/step_cost_32k.log" 2>&1; echo "rc=$?"
grep -E "│ (full|small)|small / full" "$OUT/step_cost_32k.log"

el "fp16 + grad scaler, $SHORT updates"
train --out "$W/fp16" --max-steps "$SHORT" --max-time 0 --precision fp16 > "$OUT/fp16.log" 2>&1; echo "rc=$?"
grep -E "│ (valid ppl|target tokens/s|precision / device) " "$OUT/fp16.log" | tr -s ' │' ' '

el "resume: $SHORT updates in one go against $(( SHORT / 2 )) then resumed (fp32, inverse_sqrt: lr by step only)"
R=(--max-time 0 --precision fp32 --schedule inverse_sqrt --save-every-steps 50 --save-every-progress 0)
train "${R[@]}" --out "$W/r-one" --max-steps "$SHORT" > "$OUT/resume-one.log" 2>&1; echo "rc=$?"
train "${R[@]}" --out "$W/r-two" --max-steps $(( SHORT / 2 )) > "$OUT/resume-two.log" 2>&1; echo "rc=$?"
train "${R[@]}" --out "$W/r-two" --max-steps "$SHORT" >> "$OUT/resume-two.log" 2>&1; echo "rc=$?"
$PY - "$W" "$SHORT" <<'EOF'
import sys
from safetensors.torch import load_file
w, n = sys.argv[1], int(sys.argv[2])
a, b = (load_file(f"{w}/{r}/checkpoints/step_{n:08d}/model.safetensors") for r in ("r-one", "r-two"))
print("resume: bitwise equal", all(bool((a[k] == b[k]).all()) for k in a),
      "max |diff|", max(float((a[k].float() - b[k].float()).abs().max()) for k in a))
EOF

el "torch.compile, $SHORT updates"
train --out "$W/compile" --max-steps "$SHORT" --max-time 0 --compile > "$OUT/compile.log" 2>&1; echo "rc=$?"
grep -E "│ (training time|target tokens/s|precision / device) " "$OUT/compile.log" | tr -s ' │' ' '
el "done: logs in $OUT"
