#!/usr/bin/env python3
"""The paper's Table 1, measured: one self-attention layer against one recurrent and one convolutional layer.

Section 4 of the paper compares layer types by complexity per layer (self-attention O(n^2 d), recurrent O(n d^2),
convolutional O(k n d^2), restricted self-attention O(r n d)), sequential operations (O(1), O(n), O(1), O(1)) and
maximum path length (O(1), O(n), O(log_k n) dilated / O(n/k) contiguous, O(n/r)). This bench measures, at
d = 512 on this CPU, for n = 16 ... 4,096 (one sequence, batch 1, fp32):

* **time**: forward + backward of one layer (min over ``--rounds`` interleaved rounds; each timing repeats the
  layer until ``--min-time`` seconds have passed), and the exponent b of ``time ~ n^b`` fitted on the longest
  lengths (where the n^2 d or n d^2 term dominates; at short n every layer is its d^2 projections);
* **memory**: the bytes autograd saves for the backward pass (``saved_tensors_hooks``; the input counted, the
  weights not), the activation memory a training step holds per layer, and its fitted exponent;
* **maximum path length**: measured, not assumed, as the number of stacked layers after which the first output
  position depends on the last input position (its gradient is non-zero), at ``--path-n``; for the LSTM the path
  runs through n - 1 recurrent steps of one layer;
* **sequential operations**: the recurrent layer's n dependent steps (structural: each step needs the previous
  one's state); the others are a fixed number of operations over all positions at once.

Layers: mtpipe's own self-attention (:class:`mtpipe.model.MultiHeadAttention`, h = 8, with its Q/K/V and output
projections, as in the model), restricted with ``model.attention_window`` r (``--windows``; banded from
:func:`mtpipe.kernels.banded_min_length` on, and also forced to the masked full matrix, which shows where the banded
form starts to pay), ``torch.nn.LSTM`` (d -> d, one layer) and ``torch.nn.Conv1d`` (d -> d, kernel ``--kernel``).

    python bench/complexity.py                      # ~10 min on 2 cores; PNG + markdown under bench/out/complexity
    python bench/complexity.py --max-n 1024 --rounds 1
    python bench/complexity.py --isa avx2           # the CPU restricted to AVX2 (torch and oneDNN)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from isa_probe import AVX2_ONLY  # bench/ is on the path: run as python bench/complexity.py

REPO = Path(__file__).resolve().parents[1]


def cpu_facts() -> dict[str, Any]:
    import torch

    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    flags = open("/proc/cpuinfo").read().split("flags")[1].splitlines()[0].split()
    return {"cpu": model, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "flags": sorted(f for f in set(flags) if f.startswith(("avx", "amx", "fma"))),
            "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "restricted": {k: os.environ[k] for k in AVX2_ONLY if k in os.environ}}


# --------------------------------------------------------------------------------------------------------------------
# The layers
# --------------------------------------------------------------------------------------------------------------------


def make_layer(kind: str, d: int, heads: int, kernel: int, window: int = 0) -> tuple[Any, Callable]:
    """(module, f) with ``f(x [1, n, d]) -> [1, n, d]`` one layer of ``kind``."""
    import torch

    from mtpipe.model import MultiHeadAttention

    if kind == "attention":
        m = MultiHeadAttention(d, heads, d // heads, d // heads, 0.0, True, window)
        return m, lambda x: m.self_attend(x)
    if kind == "lstm":
        m = torch.nn.LSTM(d, d, batch_first=True)
        return m, lambda x: m(x)[0]
    if kind == "conv":
        m = torch.nn.Conv1d(d, d, kernel, padding=kernel // 2)
        return m, lambda x: m(x.transpose(1, 2)).transpose(1, 2)  # [1, n, d] -> [1, d, n] -> conv -> [1, n, d]
    raise ValueError(kind)


def time_layer(f: Callable, x: Any, min_time: float) -> float:
    """Seconds per forward + backward of ``f`` on ``x``, repeated until ``min_time`` has passed."""
    reps, start = 0, time.perf_counter()
    while True:
        y = f(x)
        y.backward(gradient_of(y))
        reps += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time:
            return elapsed / reps


_GRADS: dict[tuple, Any] = {}


def gradient_of(y: Any) -> Any:
    import torch

    key = tuple(y.shape)
    if key not in _GRADS:
        _GRADS[key] = torch.randn(y.shape)
    return _GRADS[key]


def saved_bytes(module: Any, f: Callable, x: Any) -> int:
    """Bytes autograd keeps for the backward pass of ``f(x)``: each saved tensor's storage counted once (the input too:
    in a stack it is the previous layer's output), the layer's weights not (they exist without a backward pass)."""
    import torch

    storages: dict[int, int] = {}
    exclude = {p.untyped_storage().data_ptr() for p in module.parameters()}

    def pack(t: Any) -> Any:
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = f(x)
    y.backward(gradient_of(y))
    return sum(storages.values())


def path_length(kind: str, n: int, d: int, heads: int, kernel: int, window: int) -> int:
    """Stacked layers of ``kind`` needed before output position 0 depends on input position n - 1 (measured with
    gradients); for the LSTM, the recurrent steps between them (n - 1: one layer already connects them)."""
    import torch

    torch.manual_seed(0)
    if kind == "lstm":
        return n - 1
    x = torch.randn(1, n, d, requires_grad=True)
    y = x
    for depth in range(1, 2 * n + 2):
        _, f = make_layer(kind, d, heads, kernel, window)
        y = f(y)
        (g,) = torch.autograd.grad(y[0, 0].sum(), x, retain_graph=True)
        if g[0, n - 1].abs().max() > 0:
            return depth
    raise RuntimeError(f"{kind}: no path after {2 * n + 1} layers")


def fit_exponent(ns: list[int], values: list[float]) -> float:
    """Least-squares slope of log(value) against log(n)."""
    lx = [math.log(n) for n in ns]
    ly = [math.log(v) for v in values]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


# --------------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------------


def systems(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every row of the table: name, layer kind, window, whether the banded computation is allowed, the paper's
    complexity per layer and maximum path length."""
    rows = [{"name": "self-attention", "kind": "attention", "window": 0, "banded": True,
             "paper": "O(n^2 d)", "paper_path": "O(1)", "sequential": "O(1)"},
            {"name": "recurrent (LSTM)", "kind": "lstm", "window": 0, "banded": True,
             "paper": "O(n d^2)", "paper_path": "O(n)", "sequential": "O(n): n dependent steps"},
            {"name": f"convolutional (k = {args.kernel})", "kind": "conv", "window": 0, "banded": True,
             "paper": "O(k n d^2)", "paper_path": "O(n/k) (contiguous)", "sequential": "O(1)"}]
    for r in args.windows:
        rows.append({"name": f"restricted self-attention (r = {r})", "kind": "attention", "window": r,
                     "banded": True, "paper": "O(r n d)", "paper_path": "O(n/r)", "sequential": "O(1)"})
        rows.append({"name": f"restricted (r = {r}), masked full matrix", "kind": "attention", "window": r,
                     "banded": False, "paper": "(implementation)", "paper_path": "", "sequential": "O(1)"})
        rows.append({"name": f"restricted (r = {r}), banded at every n", "kind": "attention", "window": r,
                     "banded": "forced", "paper": "(implementation)", "paper_path": "", "sequential": "O(1)"})
    return rows


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import mtpipe.model as model_module
    from mtpipe.console import progress

    torch.manual_seed(0)
    ns = [n for n in (2**i for i in range(4, 16)) if args.min_n <= n <= args.max_n]
    rows = systems(args)
    times: dict[str, dict[int, list[float]]] = {r["name"]: {n: [] for n in ns} for r in rows}
    memory: dict[str, dict[int, int]] = {r["name"]: {} for r in rows}
    real_banded = model_module.banded_min_length
    with progress() as bar:
        task = bar.add_task("Table 1", total=args.rounds * len(ns) * len(rows))
        for rnd in range(args.rounds):
            for n in ns:
                x = torch.randn(1, n, args.d, requires_grad=True)
                order = rows if rnd % 2 == 0 else rows[::-1]  # interleaved, alternating order
                for row in order:
                    if row["kind"] == "lstm" and n > args.max_n_lstm:
                        bar.advance(task)
                        continue
                    model_module.banded_min_length = {True: real_banded, False: lambda r: 1 << 62,
                                                       "forced": lambda r: 0}[row["banded"]]
                    try:
                        torch.manual_seed(0)
                        layer, f = make_layer(row["kind"], args.d, args.heads, args.kernel, row["window"])
                        f(x).sum().backward()  # warm-up (oneDNN kernel choice, allocator)
                        times[row["name"]][n].append(time_layer(f, x, args.min_time))
                        if rnd == 0:
                            memory[row["name"]][n] = saved_bytes(layer, f, x)
                    finally:
                        model_module.banded_min_length = real_banded
                    bar.advance(task)
    paths = {}
    for row in rows:
        if row["banded"] is True:
            paths[row["name"]] = path_length(row["kind"], args.path_n, 64, 8, args.kernel, row["window"])
    return {"ns": ns, "rows": rows, "times": times, "memory": memory, "paths": paths}


def report(args: argparse.Namespace, res: dict[str, Any], facts: dict[str, Any]) -> str:
    ns, rows = res["ns"], res["rows"]
    fit_ns = [n for n in ns if n >= args.fit_from]
    lines = [f"# Table 1 measured, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "",
             f"{facts['cpu']}; {facts['threads']} threads; torch {facts['torch']} dispatching "
             f"{facts['torch_capability']}; CPU flags {' '.join(facts['flags'])}"
             + (f"; restricted: {facts['restricted']}" if facts["restricted"] else "") + ".",
             f"d = {args.d}, h = {args.heads}, batch 1, fp32, forward + backward of one layer; min of {args.rounds} "
             f"interleaved rounds. Exponents b of time ~ n^b and memory ~ n^b fitted on n >= {args.fit_from}; "
             f"maximum path length measured at n = {args.path_n}.", "",
             "| layer | paper: complexity per layer | fitted time exponent | fitted memory exponent | "
             "sequential operations | paper: max path length | measured path length (layers) |",
             "|---|---|---|---|---|---|---|"]
    exps = {}
    for row in rows:
        name = row["name"]
        t = [min(res["times"][name][n]) for n in fit_ns if res["times"][name][n]]
        m = [res["memory"][name][n] for n in fit_ns if n in res["memory"][name]]
        used = [n for n in fit_ns if res["times"][name][n]]
        bt = fit_exponent(used, t) if len(used) >= 2 else float("nan")
        bm = fit_exponent(used, m) if len(used) >= 2 else float("nan")
        exps[name] = (bt, bm)
        path = res["paths"].get(name)
        path_s = "" if path is None else (f"{path} recurrent steps" if row["kind"] == "lstm" else str(path))
        lines.append(f"| {name} | {row['paper']} | {bt:.2f} | {bm:.2f} | {row['sequential']} | "
                     f"{row['paper_path']} | {path_s} |")
    lines += ["", "Time per layer (ms, forward + backward; min over rounds) and memory saved for backward (MB):", "",
              "| layer | " + " | ".join(f"n={n}" for n in ns) + " |", "|---|" + "---|" * len(ns)]
    for row in rows:
        name = row["name"]
        cells = [f"{1e3 * min(res['times'][name][n]):.2f} / {res['memory'][name][n] / 2**20:.1f}"
                 if res["times"][name][n] else "–" for n in ns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    # Where the banded form starts to pay: the shortest n from which, forced at every length, it is faster than the
    # masked full matrix (at that n and every longer one).
    lines += [""]
    from mtpipe.kernels import banded_min_length

    for r in args.windows:
        b, f = f"restricted (r = {r}), banded at every n", f"restricted (r = {r}), masked full matrix"
        faster = [n for n in ns if res["times"][b][n] and min(res["times"][b][n]) < min(res["times"][f][n])]
        since = next((n for n in ns if all(m in faster for m in ns if m >= n)), None)
        lines.append(f"- r = {r}: banded computation used from n = {banded_min_length(r)}; measured faster than the "
                     f"masked full matrix from n = {since if since else 'never (in this range)'}.")
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: Path, facts: dict[str, Any], d: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = res["ns"]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    # One colour per layer kind and per window r; the line style tells mtpipe's choice (solid) from the forced
    # masked full matrix (dotted) and the forced banded form (dashed).
    colours: dict[tuple[str, int], str] = {}
    for row in res["rows"]:
        name = row["name"]
        pts = [(n, 1e3 * min(res["times"][name][n])) for n in ns if res["times"][name][n]]
        colour = colours.setdefault((row["kind"], row["window"]), f"C{len(colours)}")
        style = {True: "-", False: ":", "forced": "--"}[row["banded"]]
        ax.plot(*zip(*pts), marker="o", markersize=3, linestyle=style, color=colour, label=name)
    # Guides: slopes 1 and 2 through the self-attention's last point, to read the fitted exponents by eye.
    top = [(n, 1e3 * min(res["times"]["self-attention"][n])) for n in ns if res["times"]["self-attention"][n]]
    if top:
        n1, t1 = top[-1]
        for power, label in ((1, "∝ n"), (2, "∝ n²")):
            ax.plot([ns[0], n1], [t1 * (ns[0] / n1) ** power, t1], color="grey", linewidth=0.8, alpha=0.5,
                    linestyle="--")
            ax.annotate(label, (ns[0], t1 * (ns[0] / n1) ** power), fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("forward + backward time of one layer (ms)")
    ax.set_title(f"Table 1 measured: one layer at d = {d}, fp32, {facts['threads']} threads\n{facts['cpu']}",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kernel", type=int, default=3)
    ap.add_argument("--windows", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64, 256])
    ap.add_argument("--min-n", type=int, default=16)
    ap.add_argument("--max-n", type=int, default=4096)
    ap.add_argument("--max-n-lstm", type=int, default=4096, help="skip the LSTM above this length (it is slow)")
    ap.add_argument("--fit-from", type=int, default=1024, help="fit exponents on n >= this")
    ap.add_argument("--path-n", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds of repetitions per timing")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--isa", choices=["native", "avx2"], default="native")
    ap.add_argument("--out", type=Path, default=REPO / "bench/out/complexity")
    args = ap.parse_args()
    if args.isa == "avx2" and any(os.environ.get(k) != v for k, v in AVX2_ONLY.items()):
        # torch reads these when it loads: re-run this script with them set
        return subprocess.call([sys.executable, *sys.argv], env={**os.environ, **AVX2_ONLY})
    sys.path.insert(0, str(REPO))
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    facts = cpu_facts()
    if args.isa == "avx2" and facts["torch_capability"] not in ("AVX2", "DEFAULT"):
        raise SystemExit(f"--isa avx2 did not take effect: torch dispatches {facts['torch_capability']}")
    res = measure(args)
    md = report(args, res, facts)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "" if args.isa == "native" else f"_{args.isa}"
    plot(res, args.out / f"table1{tag}.png", facts, args.d)
    (args.out / f"table1{tag}.md").write_text(md, encoding="utf-8")
    (args.out / f"table1{tag}.json").write_text(json.dumps({"facts": facts, "args": vars(args) | {"out": str(args.out)},
                                                            **res}, indent=1, default=str), encoding="utf-8")
    print(md)
    print(f"plot: {args.out / f'table1{tag}.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
