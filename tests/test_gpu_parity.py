"""Every op with a CUDA path, run on a device and compared with the same op on the CPU: the V4.1 hash,
`HashStream` (steps, dead tokens, drafts, commit, rollback, restarts), the FP8 gather, the V4.1 gate
forward and backward (float32 and bfloat16), each table optimizer (SparseRowAdam, SparseRowAdagrad,
SparseSinkhorn), the tiers (`TieredTable`) and one training step of the small LM.

Each `compare_*(device)` builds its inputs on the CPU, runs the op with them on `device` and checks
the result against the CPU's: bit for bit where the op is exact (hashes, gathers, tiers), within a
stated tolerance where floating-point sums change order (gate, optimizers, the LM step). On CUDA
(`gpu`, skipped without a GPU) this is the compiled Triton kernels and CUDA paths against the CPU's
numba and torch paths; the same functions also run with device 'cpu' on every machine, where the
result is the CPU's own: that proves the checks run and their assertions hold.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from engram import (
    EngramConfig,
    FP8Table,
    HashStream,
    MmapFP8Table,
    NgramHasher,
    SparseRowAdagrad,
    SparseRowAdam,
    kernels,
)
from engram.kernels import reference
from engram.model.lm import EngramLM, LMConfig
from engram.model.optim import split_param_groups
from engram.model.sinkhorn import SparseSinkhorn
from engram.rowformat.fp8 import SCALE_DTYPE, VALUE_DTYPE
from engram.storage import lookup
from engram.systems import TieredTable

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns of a CPU copy, so that floats compare exactly (NaN included)."""
    t = t.detach().cpu()
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def close(got: torch.Tensor, want: torch.Tensor, rel: float, what: str, floor: float = 1.0) -> None:
    """|got - want| <= rel * max(floor, max |want|), elementwise, on the CPU."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    assert got.shape == want.shape, what
    tol = rel * max(floor, float(want.abs().max()) if want.numel() else 0.0)
    err = float((got - want).abs().max()) if want.numel() else 0.0
    assert err <= tol, f"{what}: off by {err:.3g} (tolerance {tol:.3g})"


# ------------------------------------------------------------------------------------------------ hash
def compare_hash(device: str, hasher: NgramHasher) -> None:
    """`NgramHasher.hash` of ids on `device` (CUDA: the Triton kernel) == the numpy-fed CPU hash, with
    dead tokens, window starts, int32 output and a sequence longer than a kernel program's tokens."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hasher.config.vocab_size, (3, 150), generator=g)
    dead = torch.rand(3, 150, generator=g) < 0.1
    starts = torch.rand(3, 150, generator=g) < 0.05
    for kw in ({}, {"dead_mask": dead}, {"dead_mask": dead, "starts": starts}):
        want = hasher.hash(ids.numpy(), **{k: v.numpy() for k, v in kw.items()})
        got = hasher.hash(ids.to(device), **{k: v.to(device) for k, v in kw.items()})
        assert got.device.type == device and np.array_equal(got.cpu().numpy(), want)
    got32 = hasher.hash(ids[1].to(device), dead[1].to(device), out_dtype=np.int32)
    assert got32.dtype == torch.int32 and np.array_equal(
        got32.cpu().numpy(), hasher.hash(ids[1].numpy(), dead[1].numpy())
    )


@pytest.mark.parametrize("device", DEVICES)
def test_hash(device, v41_hasher):
    compare_hash(device, v41_hasher)


# ---------------------------------------------------------------------------------------------- stream
def compare_stream(device: str, hasher: NgramHasher, ids_high: int) -> None:
    """A decode loop whose steps take ids on `device` (CUDA: the window kept on the GPU) against the
    same loop with numpy ids: every step's rows, drafts (committed in part, or rolled back), window
    starts, dead tokens, and the committed state at the end."""
    g = torch.Generator().manual_seed(1)
    b, steps = 3, 14
    prefix = torch.randint(0, ids_high, (b, 5), generator=g).numpy()
    ids = torch.randint(0, ids_high, (steps, b), generator=g)
    dead = torch.rand(steps, b, generator=g) < 0.2
    starts = torch.rand(steps, b, generator=g) < 0.15
    drafts = torch.randint(0, ids_high, (b, 3), generator=g).numpy()
    host, dev = HashStream(hasher, b), HashStream(hasher, b)
    for s in (host, dev):
        s.feed(prefix)
    for t in range(steps):
        if t in (4, 9):  # a draft round: kept in part (t 4) or all rolled back (t 9)
            want = host.draft(drafts)
            assert np.array_equal(dev.draft(torch.from_numpy(drafts).to(device)).cpu().numpy(), want)
            for s in (host, dev):
                s.commit([0, 1, 3]) if t == 4 else s.rollback()
        kw = {"dead_mask": dead[t]} if t % 3 else {"starts": starts[t]}
        want = host.step(ids[t].numpy(), **{k: v.numpy() for k, v in kw.items()})
        got = dev.step(ids[t].to(device), **{k: v.to(device) for k, v in kw.items()})
        assert got.device.type == device and np.array_equal(got.cpu().numpy(), want), t
    assert np.array_equal(dev.window, host.window) and np.array_equal(dev.position, host.position)


@pytest.mark.parametrize("device", DEVICES)
def test_stream_drafts_rollback(device, v41_hasher):
    compare_stream(device, v41_hasher, 129280)


@pytest.mark.parametrize("device", DEVICES)
def test_stream_restarts(device):
    """restart_after_id (id 2 here, drawn often): the window restarts after it on either device."""
    config = EngramConfig.preset("tiny").replace(
        vocab_size=20, compressed_vocab_size=20, pad_token_id=3, restart_after_id=2
    )
    compare_stream(device, NgramHasher(config), 6)


# ---------------------------------------------------------------------------------------------- lookup
def compare_fp8_gather(device: str) -> None:
    """The FP8 gather on `device` (CUDA: the Triton kernel) == the CPU's torch path, bit for bit: every
    value byte under every scale byte (NaN bytes NaN), and a table through FP8Table with int32 ids."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(255, 1).view(VALUE_DTYPE)
    scales = torch.arange(255, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, 8).view(SCALE_DTYPE)
    rows = torch.randperm(255, generator=torch.Generator().manual_seed(2)).view(5, 51)
    g = torch.Generator().manual_seed(3)
    table = FP8Table.from_float(torch.randn(300, 96, generator=g) * 10)  # 96 wide: a partial tile
    on_dev = FP8Table(table.weight.to(device), table.scale.to(device))
    ids = torch.randint(0, 300, (7, 24), generator=g)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        want = lookup.dequantize_gather(values, scales, rows, dtype, backend="torch")
        got = lookup.dequantize_gather(values.to(device), scales.to(device), rows.to(device), dtype)
        assert got.device.type == device and torch.equal(bits(got), bits(want)), dtype
        for idt in (torch.int64, torch.int32):
            want = table.gather(ids.to(idt), dtype)
            assert torch.equal(bits(on_dev.gather(ids.to(idt).to(device), dtype)), bits(want)), (dtype, idt)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_gather(device):
    compare_fp8_gather(device)


# ------------------------------------------------------------------------------------------------ gate
def _gate_inputs(b: int, t: int, hc: int, dim: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    kv = torch.randn(b, t, hc + 1, dim, generator=g)  # key and v are views of it, as in the module
    kv[0, 0, :hc] = torch.randn(dim, generator=g) * 0.01  # a tiny |z|: the clamp's branch
    h = torch.randn(b, t, hc, dim, generator=g)
    h[-1, -1] = kv[-1, -1, :hc] * 3  # aligned h and key: a large gate
    w = 1 + 0.1 * torch.randn(hc, dim, generator=g)
    dead = torch.rand(b, t, generator=g) < 0.25
    dead[0, 0] = dead[-1, -1] = False
    return {"h": h, "kv": kv, "w": w, "dead": dead}


def _run_gate(fn, x: dict[str, torch.Tensor], device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """(out, gates, dh, dkv, dw) of `fn` on `device` in `dtype`, the loss a fixed probe of both outputs."""
    h, kv, w = (x[k].to(device, dtype).requires_grad_() for k in ("h", "kv", "w"))
    hc = h.shape[2]
    out, gates = fn(h, kv[:, :, :hc], kv[:, :, hc], w, x["dead"].to(device), 1e-6, 1e-6)
    probe_out = torch.linspace(-1, 1, out.numel(), device=device).view_as(out)
    probe_g = torch.linspace(2, -1, gates.numel(), device=device).view_as(gates)
    loss = (out.float() * probe_out).sum() + (gates.float() * probe_g).sum()
    return [out, gates, *torch.autograd.grad(loss, (h, kv, w))]


def compare_gate(device: str, dtype: torch.dtype, shape: tuple[int, int, int, int]) -> None:
    """The gate Engram's V4.1 forward trains with on `device` (CUDA: the fused Triton forward and
    backward; CPU: the eager twin) against the CPU. float32: outputs and grads within 1e-5 of the
    CPU's, relative to the largest value. bfloat16: as close to the CPU's float32 math on the same
    rounded inputs as the CPU's own bfloat16 eager code is (2x its error, at least 1e-2 relative)."""
    x = _gate_inputs(*shape)
    fn = kernels.fused_gate if kernels.use_triton(torch.empty(0, device=device)) else reference.gate
    got = _run_gate(fn, x, device, dtype)
    names = ("out", "gates", "dh", "dkv", "dw")
    if dtype == torch.float32:
        want = _run_gate(reference.gate, x, "cpu", torch.float32)
        for name, a, e in zip(names, got, want, strict=True):
            assert a.dtype == e.dtype, name
            close(a, e, 1e-5, name)
        return
    rounded = {k: v.to(dtype).float() if v.is_floating_point() else v for k, v in x.items()}
    truth = [t.detach() for t in _run_gate(reference.gate, rounded, "cpu", torch.float32)]
    eager = [e.detach() for e in _run_gate(reference.gate, x, "cpu", dtype)]
    for name, a, e, t in zip(names, got, eager, truth, strict=True):
        assert a.dtype == e.dtype == dtype, name
        err_cpu = float((e.double() - t.double()).abs().max())
        close(a, t, max(2 * err_cpu / max(1.0, float(t.abs().max())), 1e-2), name)


@pytest.mark.parametrize("shape", [(2, 5, 4, 96), (1, 40, 1, 64), (1, 70, 4, 5120)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_gate_forward_backward(device, dtype, shape):
    """Shapes: several blocks of dim (96, 5120 as V4.1's hidden size) and of tokens (40, 70)."""
    compare_gate(device, dtype, shape)


# ------------------------------------------------------------------------------------------ optimizers
def _sparse_grad(rows: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """An uncoalesced sparse COO gradient, one entry per listed row (repeats kept)."""
    return torch.sparse_coo_tensor(rows.view(1, -1), values, shape, check_invariants=True)


def compare_optimizer(device: str, make, rel: float) -> None:
    """Three steps of a table optimizer on a table on `device` against the same steps on the CPU, the
    gradients sparse with repeated rows, a row touched once then left: the weights and every state
    tensor within `rel` (relative to the largest value)."""
    g = torch.Generator().manual_seed(5)
    w0 = torch.randn(300, 64, generator=g) * 0.02
    grads = []
    for step in range(3):
        rows = torch.randint(0, 120 if step else 300, (80,), generator=g)  # later steps: rows 0..119
        grads.append((rows, torch.randn(80, 64, generator=g)))
    result = []
    for dev in ("cpu", device):
        p = torch.nn.Parameter(w0.clone().to(dev))
        opt = make([p])
        for rows, values in grads:
            p.grad = _sparse_grad(rows.to(dev), values.to(dev), tuple(p.shape))
            opt.step()
        result.append((p.detach(), {k: v for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}))
    (want, want_state), (got, got_state) = result
    assert got.device.type == device
    close(got, want, rel, "weights")
    assert got_state.keys() == want_state.keys()
    for k in want_state:
        if want_state[k].is_floating_point():
            close(got_state[k], want_state[k], rel, k)
        else:
            assert torch.equal(got_state[k].cpu(), want_state[k]), k


OPTIMIZERS = {
    "adam": lambda ps: SparseRowAdam(ps, lr=1e-2, weight_decay=0.1),
    "adagrad": lambda ps: SparseRowAdagrad(ps, lr=1e-2),
    "sinkhorn": lambda ps: SparseSinkhorn(ps, lr=1e-2),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("device", DEVICES)
def test_table_optimizer(device, name):
    """SparseSinkhorn on CUDA runs the Triton passes (blend, row and column norms, apply); on the CPU
    the numba ones. float32 state: 1e-5 relative."""
    compare_optimizer(device, OPTIMIZERS[name], 1e-5)


# ----------------------------------------------------------------------------------------------- tiers
def compare_tiers(device: str, folder) -> None:
    """TieredTable computing on `device`, its FP8 rows on the device, in host DRAM (with and without a
    hot-row cache) or on SSD: every gather (and a prefetched one) == FP8Table.gather on the CPU, bit
    for bit, as the cache warms up."""
    g = torch.Generator().manual_seed(6)
    spread = torch.exp(torch.randn(500, 1, generator=g) * 2)  # rows of very different magnitudes
    fp8 = FP8Table.from_float(torch.randn(500, 64, generator=g) * spread)
    path = folder / "t.safetensors"
    save_file({"t.weight": fp8.weight, "t.scale": fp8.scale}, str(path))
    mmap = MmapFP8Table(path, "t.weight", "t.scale")
    cases = [("device", fp8, 0), ("host", fp8, 0), ("host", fp8, 40), ("ssd", mmap, 40)]
    for placement, table, cache_rows in cases:
        t = TieredTable(table, placement, cache_rows=cache_rows, device=device)
        for step in range(4):
            rows = torch.randint(0, 500, (6, 16), generator=g)
            rows[0, 0] = rows[1, 1]  # a repeat within a call
            for dtype in (torch.float32, torch.bfloat16):
                want = fp8.gather(rows, dtype)
                got = t.gather(rows if step % 2 else rows.to(device), dtype)
                assert got.device.type == device and torch.equal(bits(got), bits(want)), (placement, step)
                handle = t.prefetch(rows)
                assert torch.equal(bits(t.gather(rows, dtype, prefetched=handle)), bits(want)), placement


@pytest.mark.parametrize("device", DEVICES)
def test_tiers(device, tmp_path):
    compare_tiers(device, tmp_path)


# ------------------------------------------------------------------------------------------------- LM
def compare_lm_step(device: str) -> None:
    """One training step of a small EngramLM (V4.1 Engram at layer 1, 2 residual streams mixed by
    Sinkhorn, tied embeddings) on `device` against the CPU: the loss within 1e-5, every gradient
    within 1e-4 of its largest value (the table's sparse row gradient too), and after AdamW and
    SparseRowAdam every weight within a tenth of the learning rate (a sign flipped by rounding in a
    gradient that is not near zero would move it by up to 2 lr)."""
    vocab, lr = 64, 1e-3
    engram = EngramConfig.preset("tiny").replace(
        vocab_size=vocab, compressed_vocab_size=vocab, pad_token_id=3, engram_vocab_size=(211, 223)
    )
    config = LMConfig(
        vocab_size=vocab, dim=64, n_layers=2, n_heads=2, mlp_hidden=96, max_seq_len=16, hc=2,
        engram=engram, engram_zero_init=False,
    )  # fmt: skip
    torch.manual_seed(7)
    base = EngramLM(config)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, vocab, (3, 17), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    rows = torch.from_numpy(NgramHasher(engram).hash(x.numpy()))
    result = []
    for dev in ("cpu", device):
        model = EngramLM(config).to(dev)
        model.load_state_dict(base.state_dict())
        dense, tables = split_param_groups(model)
        adamw, sparse = torch.optim.AdamW(dense, lr=lr), SparseRowAdam(tables, lr=lr)
        loss = F.cross_entropy(model(x.to(dev), rows.to(dev)).flatten(0, 1), y.to(dev).flatten())
        loss.backward()
        grads = {n: p.grad.to_dense() if p.grad.is_sparse else p.grad for n, p in model.named_parameters()}
        adamw.step()
        sparse.step()
        result.append((loss.detach(), grads, {n: p.detach() for n, p in model.named_parameters()}))
    (want_loss, want_grads, want_w), (got_loss, got_grads, got_w) = result
    assert got_loss.device.type == device
    close(got_loss, want_loss, 1e-5, "loss")
    assert got_grads.keys() == want_grads.keys() and any("table" in n for n in want_grads)
    for n in want_grads:
        close(got_grads[n], want_grads[n], 1e-4, n, floor=0.0)
    for n in want_w:
        err = float((got_w[n].cpu() - want_w[n]).abs().max())
        assert err <= 0.1 * lr, f"{n}: off by {err:.3g} after the step"


@pytest.mark.parametrize("device", DEVICES)
def test_lm_training_step(device):
    compare_lm_step(device)
