"""``python -m bench.anchors.fs_budget --self-check``: the rule equals
``mtpipe.training.update.linear_learning_rate`` at every share of a time or an update budget, and the quality
part hands fairseq this scheduler for a ``linear`` run and fs_train.sh's own for ``inverse_sqrt`` (fairseq itself
is not needed)."""

from __future__ import annotations

import argparse
import math


def self_check() -> None:
    from bench.anchors.fs_budget import budget_linear_rate
    from bench.anchors.quality import FS_BUDGET, fairseq_settings
    from mtpipe.training.update import linear_learning_rate

    def close(a: float, b: float) -> bool:
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)

    d, w, scale, budget, n = 128, 1000, 1.79, 37 * 60.0, 2000
    peak = scale * d**-0.5 * w**-0.5
    for update in (1, 10, 500, 1000, 1500, 3000, 4438):  # a time budget: the share of it spent
        for seconds in (0.0, 60.0, 555.0, 1800.0, budget, budget + 5):
            assert close(budget_linear_rate(update, seconds, peak, w, budget_seconds=budget),
                         linear_learning_rate(update, min(1.0, seconds / budget), d, w, scale)), (update, seconds)
    for update in range(1, n + 1, 37):  # an update budget: update k runs at the share spent before it
        assert close(budget_linear_rate(update, 1e9, peak, w, max_updates=n),
                     linear_learning_rate(update, (update - 1) / n, d, w, scale)), update
    assert budget_linear_rate(5000, budget, peak, w, budget_seconds=budget) == 0.0  # the budget is spent
    mc = {"encoder_layers": 4, "decoder_layers": 4, "d_model": d, "d_ff": 256, "heads": 4, "dropout": 0.2,
          "attention_dropout": 0.0, "relu_dropout": 0.0, "norm_position": "pre"}
    tc = {"lr_scale": scale, "warmup": w, "label_smoothing": 0.1, "schedule": "linear"}
    flags = [str(f) for f in fairseq_settings("run", mc, tc)[1]]
    opt = dict(zip(flags, flags[1:]))
    assert opt["--lr-scheduler"] == "budget_linear" and opt["--user-dir"] == str(FS_BUDGET), opt
    assert close(float(opt["--lr"]), float(f"{peak:.6g}")) and opt["--warmup-updates"] == str(w), opt
    assert "--encoder-normalize-before" in flags
    assert "--lr-scheduler" not in fairseq_settings("run", mc, {**tc, "schedule": "inverse_sqrt"})[1]
    print("fs_budget: the rule and the quality part's flags agree with mtpipe's linear schedule")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--self-check", action="store_true", required=True)
    ap.parse_args()
    self_check()
