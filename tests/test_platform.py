"""mtpipe.platform: the machine read once, lazily, and asked rather than flipped; the decisions made from it (threads,
TF32, autocast, the device). Precision's ``auto`` and the ISA restrictions: test_train.py; the device rules:
test_decode_cli.py; that no other module decides these: test_layering.py. Also the contexts through which a benchmark
switches one of the operators' tricks off for a block (no module global is set from outside)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtpipe import platform

REPO = Path(__file__).resolve().parents[1]


def test_importing_mtpipe_probes_nothing() -> None:
    """No module of mtpipe asks torch for the CPU's capability or oneDNN, or reads /proc/cpuinfo, when it is imported:
    the machine is read on the first question (and then once)."""
    names = sorted(".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
                   for p in (REPO / "mtpipe").rglob("*.py") if p.name != "__main__.py")
    code = ("import importlib, pathlib, torch\n"
            "asked = []\n"
            "cap, dnn, read = torch.backends.cpu.get_cpu_capability, torch.backends.mkldnn.is_available, "
            "pathlib.Path.read_text\n"
            "torch.backends.cpu.get_cpu_capability = lambda: asked.append('capability') or cap()\n"
            "torch.backends.mkldnn.is_available = lambda: asked.append('onednn') or dnn()\n"
            "pathlib.Path.read_text = lambda self, *a, **k: (asked.append(str(self)) if 'cpuinfo' in str(self) "
            "else None) or read(self, *a, **k)\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "assert not asked, asked\n"
            "from mtpipe import platform\n"
            "first = platform.cpu()\n"
            "assert platform.cpu() is first and asked.count('capability') == 1, asked\n"
            "assert '/proc/cpuinfo' in asked or not pathlib.Path('/proc/cpuinfo').exists(), asked\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_importing_platform_loads_no_torch() -> None:
    """The stages that only count CPUs (bpe, the launcher) pay nothing for torch through mtpipe.platform."""
    code = "import sys; from mtpipe import platform; platform.cpu_count(); assert 'torch' not in sys.modules"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_an_assumed_cpu_holds_inside_its_block_only() -> None:
    real = platform.cpu()
    with platform.assume_cpu(capability="AVX2", flags=frozenset()) as cpu:
        assert platform.cpu() is cpu and cpu.capability == "AVX2" and not cpu.native_bf16
        assert cpu.isa_limit == real.isa_limit  # the facts not named stay this machine's
        with platform.assume_cpu(capability="AMX") as inner:
            assert platform.cpu() is inner and inner.native_bf16  # nested: the inner one
        assert platform.cpu() is cpu
    assert platform.cpu() is real
    with pytest.raises(RuntimeError), platform.assume_cpu(capability="AVX2"):
        raise RuntimeError
    assert platform.cpu() is real  # restored after an error too


def test_threads_per_process_split_this_processs_cpus() -> None:
    cpus = platform.cpu_count()
    assert cpus >= 1
    assert platform.threads_per_process(3, 8) == 3  # a setting wins
    assert platform.threads_per_process(0) == cpus
    assert platform.threads_per_process(0, 2) == max(1, cpus // 2)
    assert platform.threads_per_process(0, cpus * 4) == 1  # at least one each


def test_threads_hold_for_their_block_and_are_restored() -> None:
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    with platform.threads(other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before
    with platform.threads(0):  # 0: left as they are
        assert torch.get_num_threads() == before
    assert torch.get_num_threads() == before


def test_torch_threads_are_the_setting_or_torchs_own() -> None:
    """What CTranslate2 is told (decode.threads 0): the threads torch runs with now, not the CPU count."""
    before = torch.get_num_threads()
    assert platform.torch_threads(3) == 3 and platform.torch_threads() == before
    other = 1 if before != 1 else 2
    with platform.threads(other):
        assert platform.torch_threads(0) == other and platform.torch_threads(5) == 5


def test_torchrun_threads_share_the_cpus_unless_told() -> None:
    """train.threads for torchrun's processes: a setting wins, OMP_NUM_THREADS leaves torch's choice (0), else this
    process's CPUs split among them (torchrun alone would give each one thread)."""
    assert platform.torchrun_threads(3, 2, {}) == 3
    assert platform.torchrun_threads(3, 2, {"OMP_NUM_THREADS": "5"}) == 3
    assert platform.torchrun_threads(0, 2, {"OMP_NUM_THREADS": "5"}) == 0
    assert platform.torchrun_threads(0, 2, {}) == max(1, platform.cpu_count() // 2)
    assert platform.torchrun_threads(0, platform.cpu_count() * 4, {"OTHER": "1"}) == 1


def test_tf32_is_set_for_a_gpu_only() -> None:
    """Training's float32 matmuls: TF32 on a CUDA device, the CPU's left as torch has them (the switches are torch's
    process-wide flags, which can be set without a GPU)."""
    flags = torch.backends.cuda.matmul, torch.backends.cudnn
    before = [f.allow_tf32 for f in flags]
    try:
        for f in flags:
            f.allow_tf32 = False
        platform.set_fp32_matmuls(torch.device("cpu"))
        assert [f.allow_tf32 for f in flags] == [False, False]
        platform.set_fp32_matmuls(torch.device("cuda"))
        assert [f.allow_tf32 for f in flags] == [True, True]
    finally:
        for f, value in zip(flags, before):
            f.allow_tf32 = value


def test_autocast_per_precision() -> None:
    cpu = torch.device("cpu")
    with platform.autocast(cpu, "bf16"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    for precision in ("fp32", "int8"):
        with platform.autocast(cpu, precision):
            assert not torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")



def test_int8_without_a_quantised_engine_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """decode.precision=int8 asks the platform which quantised engine torch has; a build with none is refused
    before any layer is quantised, in one line naming the setting."""
    from mtpipe.config import ModelConfig
    from mtpipe.engine import variants
    from mtpipe.errors import MtpipeError
    from mtpipe.model.transformer import build_model

    model = build_model(ModelConfig(preset="tiny"), 64)
    assert variants.int8_copy(model) is not model  # this build has one: the copy is made
    monkeypatch.setattr(platform, "kernels",
                        lambda: platform.Kernels(onednn=False, fbgemm=False, quantised="none"))
    with pytest.raises(MtpipeError, match=r"^decode.precision=int8: this torch build has no quantised CPU engine"):
        variants.int8_copy(model)


# --------------------------------------------------------------------------------------------------------------------
# The operators' tricks switched off for a block (bench/ --plain rows)
# --------------------------------------------------------------------------------------------------------------------


def test_fused_dropout_is_torchs_dropout_for_its_block_only() -> None:
    """ops.fused_dropout (bench/train_throughput.py --plain dropout): inside the block CPU dropout draws torch's
    F.dropout masks (the same as F.dropout from the same seed), before and after it keep_mask's."""
    import torch.nn.functional as F

    from mtpipe.model import ops

    x = torch.ones(4, 64)

    def drawn(fn) -> torch.Tensor:
        torch.manual_seed(0)
        return fn()

    cheap = drawn(lambda: ops.dropout(x, 0.3, True))
    plain = drawn(lambda: F.dropout(x, 0.3, training=True))
    assert not torch.equal(cheap, plain)
    with ops.fused_dropout():
        assert torch.equal(drawn(lambda: ops.dropout(x, 0.3, True)), plain)
        assert torch.equal(drawn(lambda: ops.residual(x, x, 0.3, True)), x + plain)
    assert torch.equal(drawn(lambda: ops.dropout(x, 0.3, True)), cheap)


def test_whole_logits_compute_the_blocks_loss_for_its_block_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """loss.whole_logits (bench/train_throughput.py --plain loss): inside the block the loss and its gradients come
    from the whole logits through autograd, the same values as the blocks' up to float rounding; the blocks
    before and after."""
    from mtpipe.training import loss

    blocks = []
    real = loss._blocks
    monkeypatch.setattr(loss, "_blocks", lambda *a, **k: blocks.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(0)
    h, w, b = (torch.randn(*shape, generator=g, requires_grad=True) for shape in ((6, 8), (11, 8), (11,)))
    target = torch.tensor([0, 3, 10, 2, 2, 7])

    def run() -> list[torch.Tensor]:
        for t in (h, w, b):
            t.grad = None
        total, nll = loss.projected_label_smoothed_nll(h, w, b, target, 0.1)
        total.backward()
        return [total.detach(), nll.detach(), h.grad, w.grad, b.grad]

    blocked = run()
    assert len(blocks) == 1
    with loss.whole_logits():
        whole = run()
    assert len(blocks) == 1  # no block inside it
    run()
    assert len(blocks) == 2
    for a, c in zip(whole, blocked):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


def test_gather_in_graph_from_holds_for_its_block_only() -> None:
    """runners.gather_in_graph_from (bench/decode_speed.py --plain gather): the threshold the compiled step reads at
    every step is the block's inside it, the default again after it (also when the block raises)."""
    from mtpipe.engine import runners

    default = runners._GATHER_IN_GRAPH_BYTES
    with runners.gather_in_graph_from(1 << 40):
        assert runners._GATHER_IN_GRAPH_BYTES == 1 << 40
    assert runners._GATHER_IN_GRAPH_BYTES == default
    with pytest.raises(RuntimeError), runners.gather_in_graph_from(0):
        raise RuntimeError
    assert runners._GATHER_IN_GRAPH_BYTES == default


_KERNEL_CACHE_PROBE = """
import os, sys
from mtpipe import platform
import torch
kernel = platform.onednn_linear()
if kernel is None:
    print("no-onednn"); sys.exit(0)
print(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], os.environ["LRU_CACHE_CAPACITY"])
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
w = torch.randn(96, 32)
packed = kernel.pack(w)
with torch.inference_mode():
    for n in range(1, 40):  # the first kernels, and the allocator's first growth, before the measurement
        kernel.linear(torch.randn(n, 32), packed, None)
    before = rss()
    for n in range(40, 400):  # a kernel per new shape, as a corpus's batches bring them
        kernel.linear(torch.randn(n, 32), packed, None)
print(rss() - before)
"""


def _kernel_cache_probe(extra: dict[str, str]) -> tuple[str, int]:
    unset = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
    environ = {k: v for k, v in os.environ.items() if k not in unset}
    out = subprocess.run([sys.executable, "-c", _KERNEL_CACHE_PROBE], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={**environ, **extra})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split("\n")
    return lines[0], int(lines[1]) if len(lines) > 1 and lines[1] else 0


def test_onednn_kernel_caches_are_bounded_unless_set() -> None:
    """Decoding on oneDNN's float32 kernel bounds its two kernel caches (unless the variables are set): a kernel per
    new product shape then no longer grows the process for the first thousand shapes."""
    caps, bounded = _kernel_cache_probe({})
    if caps == "no-onednn":
        pytest.skip("this torch build has no oneDNN float32 linear kernel")
    assert caps == f"{platform.KERNEL_CACHE} {platform.KERNEL_CACHE}"
    caps, default = _kernel_cache_probe({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "1024"})
    assert caps == "1024 1024"  # a user's setting is left alone
    assert bounded < default / 2, (bounded, default)
