"""`HashStream` with its state on a device (addressing/stream_device.py and the decode kernels of
kernels/triton_hash.py) against the host stream, and the kernels against their torch twins.

On a machine with CUDA the kernels run compiled on the GPU; elsewhere under triton's interpreter on
CPU tensors, with `engram.kernels.use_triton` forced so that the stream takes its device path there
(conftest.py switches the interpreter on before triton is imported). Everything compares exactly:
rows, windows, positions, drafts. The `gpu` tests add what needs a real device: CUDA graphs
(captured step, draft and commit against the host; a replay with another batch size refused) and
the absence of host syncs in a step, a draft and a commit.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

import engram.kernels as kmod
from engram import EngramConfig, HashStream, NgramHasher
from engram.kernels import reference
from engram.kernels.stream_state import StreamLayout

pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


@pytest.fixture
def device_path(monkeypatch) -> Iterator[None]:
    """The stream's device path: CUDA, or the interpreted kernels on CPU tensors."""
    pytest.importorskip("triton")
    if not CUDA:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.zeros, InterpretedFunction):
            pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
        monkeypatch.setattr(kmod, "use_triton", lambda *tensors: True)
    yield


def restart_hasher(n: int = 3) -> NgramHasher:
    """A small layout whose windows restart after id 2 (drawn often from ids 0..7)."""
    config = EngramConfig.preset("tiny").replace(
        vocab_size=20, compressed_vocab_size=20, pad_token_id=3, restart_after_id=2, max_ngram_size=n
    )
    return NgramHasher(config)


# ------------------------------------------------------------------------------- kernels vs twins
@pytest.mark.parametrize("n_gram", [2, 3, 4])
def test_kernels_match_torch_twins(device_path, n_gram):
    """`stream_hash` (steps and drafts, with bad ids, full drafts, drafts in the way) and
    `stream_commit` (counts above the drafts too) == `reference.stream_hash` / `stream_commit`:
    the rows and every column of the packed state."""
    from engram.kernels import triton_hash

    h = restart_hasher(n_gram)
    lut, mult, primes, offsets = h.device_tables(DEVICE)
    b, lay = 5, StreamLayout(h.window_size, 4)
    state = torch.zeros(b, lay.columns, dtype=torch.int64, device=DEVICE)
    state[:, : lay.window] = h.pad
    twin = state.clone()
    g = torch.Generator().manual_seed(n_gram)
    for it in range(14):
        draft = it % 3 == 1
        t = int(torch.randint(1, 4, (), generator=g)) if draft else 1
        ids = torch.randint(-1, 9, (b, t), generator=g)  # -1: a bad id now and then
        dead = torch.rand(b, t, generator=g) < 0.2
        starts = torch.rand(b, t, generator=g) < 0.2
        seqs = torch.tensor([3, 0, 4]) if it == 4 else None
        n = b if seqs is None else 3
        ids, dead, starts = ids[:n], dead[:n], starts[:n]
        shape = (n, t, *h.output_shape(()))
        want = torch.empty(shape, dtype=torch.int64)
        got = torch.empty(shape, dtype=torch.int32 if it % 2 else torch.int64, device=DEVICE)
        args = (h.pad, h.config.restart_after_id)
        reference.stream_hash(
            ids,
            dead,
            starts,
            seqs,
            twin,
            lay,
            *(x.cpu() for x in (lut, mult, primes, offsets)),
            *args,
            want,
            draft=draft,
        )
        on = [None if x is None else x.to(DEVICE) for x in (ids, dead, starts, seqs)]
        triton_hash.stream_hash(*on, state, lay, lut, mult, primes, offsets, *args, got, draft=draft)
        assert torch.equal(got.cpu().long(), want), it
        assert torch.equal(state.cpu(), twin), it
        if it % 3 == 2:
            k = torch.randint(-1, 4, (b,), generator=g)
            reference.stream_commit(k, twin, lay, h.pad)
            triton_hash.stream_commit(k.to(DEVICE), state, lay, h.pad)
            assert torch.equal(state.cpu(), twin), it
    assert (twin[:, lay.err] != 0).any()  # the errors were exercised


# ------------------------------------------------------------------------------- stream vs host
def run_session(host: HashStream, dev: HashStream, ids_high: int, steps: int, seed: int) -> None:
    """A decode session on both streams: steps with dead tokens and window starts, draft rounds of
    one to three calls (kept in part with host counts or a device tensor, or rolled back; one round on
    a subset of the sequences), a reset and a host-side feed in the middle (the device state comes
    down and goes back). Every call's rows equal, then the state."""
    g = torch.Generator().manual_seed(seed)
    b = host.batch_size
    for t in range(steps):
        if t == steps // 2:  # host-side work on a device-resident stream
            for s in (host, dev):
                s.reset([1])
            chunk = torch.randint(0, ids_high, (b, 3), generator=g).numpy()
            assert np.array_equal(dev.feed(chunk), host.feed(chunk))
        if t % 4 == 1:  # a draft round
            for r in range(1 + t % 3):
                k = 1 + (t + r) % 3
                d = torch.randint(0, ids_high, (b, k), generator=g)
                dm = torch.rand(b, k, generator=g) < 0.15
                if t % 8 == 5 and r == 0:  # a round on two of the sequences
                    want = host.draft(d[:2].numpy(), dm[:2].numpy(), seqs=[2, 0])
                    got = dev.draft(d[:2].to(DEVICE), dm[:2].to(DEVICE), seqs=[2, 0])
                else:
                    want = host.draft(d.numpy(), dm.numpy())
                    got = dev.draft(d.to(DEVICE), dm.to(DEVICE))
                assert np.array_equal(got.cpu().numpy(), want), (t, r)
            if t % 12 == 9:
                for s in (host, dev):
                    s.rollback()
            else:
                n = np.minimum(torch.randint(0, 5, (b,), generator=g).numpy(), host.n_draft)
                host.commit(n)
                dev.commit(torch.from_numpy(n).to(DEVICE) if t % 2 else n.tolist())
        ids = torch.randint(0, ids_high, (b,), generator=g)
        kw = {}
        if t % 3:
            kw["dead_mask"] = torch.rand(b, generator=g) < 0.2
        if t % 2:
            kw["starts"] = torch.rand(b, generator=g) < 0.15
        want = host.step(ids.numpy(), **{k: v.numpy() for k, v in kw.items()})
        got = dev.step(ids.to(DEVICE), **{k: v.to(DEVICE) for k, v in kw.items()})
        assert got.device == ids.to(DEVICE).device and np.array_equal(got.cpu().numpy(), want), t
    dev.check()
    assert dev._resident  # the session ran on the device
    assert np.array_equal(dev.window, host.window)
    assert np.array_equal(dev.position, host.position)
    assert np.array_equal(dev.n_draft, host.n_draft)


def test_device_stream_v41(device_path, v41_hasher):
    b = 3
    host, dev = HashStream(v41_hasher, b), HashStream(v41_hasher, b, max_draft=8)
    prefix = torch.randint(0, 129280, (b, 5), generator=torch.Generator().manual_seed(0)).numpy()
    for s in (host, dev):
        s.feed(prefix)
    run_session(host, dev, 129280, 20, seed=1)


@pytest.mark.parametrize("n_gram", [2, 3])
def test_device_stream_restarts(device_path, n_gram):
    """Restart ids drawn often: the window restarts after them through steps, drafts and commits."""
    h = restart_hasher(n_gram)
    host, dev = HashStream(h, 4), HashStream(h, 4, max_draft=9)
    run_session(host, dev, 8, 32, seed=n_gram)


def test_device_errors_are_recorded(device_path, v41_hasher):
    """On the device nothing raises in a step, draft or commit: a bad id, drafts in the way, a draft
    past max_draft, a commit of too many leave that sequence unchanged, give in-range rows, and
    `check()` (or the next host-side method) raises once."""
    b = 3
    host, dev = HashStream(v41_hasher, b), HashStream(v41_hasher, b, max_draft=2)
    for s in (host, dev):
        s.feed(np.array([[5, 6], [7, 8], [9, 10]]))
    rows = dev.step(torch.tensor([1, 129280, 2], device=DEVICE))  # no raise here
    want = host.step(np.array([1, 4, 2]))
    got = rows.cpu().numpy()
    assert np.array_equal(got[[0, 2]], want[[0, 2]])
    dead_rows = HashStream(v41_hasher, 1).step(np.array([0]), np.array([True]))[0]
    assert np.array_equal(got[1], dead_rows)  # the bad sequence: a dead token's rows
    with pytest.raises(ValueError, match=r"id 129280 for sequence 1 at position 2"):
        dev.check()
    dev.check()  # reported once
    host.rollback()
    assert np.array_equal(dev.position, [3, 2, 3])  # sequence 1 did not move

    ids = torch.tensor([[1, 2], [3, 4], [5, 6]], device=DEVICE)
    dev.draft(ids)
    dev.draft(ids[:, :1])  # past max_draft=2: recorded
    with pytest.raises(ValueError, match="passes max_draft=2"):
        dev.check()
    dev.step(torch.tensor([1, 2, 3], device=DEVICE))  # drafts pending: recorded
    with pytest.raises(RuntimeError, match="drafted tokens are pending for sequence 0"):
        _ = dev.window  # a host-side method raises the pending error first
    dev.commit(torch.tensor([1, 3, 0], device=DEVICE))  # sequence 1 asks for 3 of 2
    with pytest.raises(ValueError, match="cannot commit 3 tokens of sequence 1: it has 2 drafted"):
        dev.check()
    assert np.array_equal(dev.n_draft, [0, 2, 0]) and np.array_equal(dev.position, [4, 2, 3])
    with pytest.raises(ValueError, match="counts are >= 0"):
        dev.commit(-1)
    dev.rollback()
    with pytest.raises(ValueError, match="passes max_draft=2"):  # a host draft on the device-resident state
        dev.draft(np.array([[1, 2, 3]] * 3))
    with pytest.raises(ValueError, match="one token per sequence"):
        dev.step(torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="out must be"):
        dev.step(torch.zeros(3, dtype=torch.int64, device=DEVICE), out=torch.empty(3, 2, 5, device=DEVICE))
    with pytest.raises(TypeError, match="integer token ids"):
        dev.step(torch.zeros(3, device=DEVICE))
    dev.check()


def test_device_state_moves(device_path, v41_hasher):
    """to_device with host drafts pending, to_host, and the upload refusing more drafts than max_draft."""
    b = 2
    host, dev = HashStream(v41_hasher, b), HashStream(v41_hasher, b, max_draft=3)
    for s in (host, dev):
        s.feed(np.array([[5, 6, 7], [8, 9, 10]]))
        s.draft(np.array([[11, 12], [13, 14]]))
    dev.to_device(DEVICE)
    assert np.array_equal(
        dev.draft(torch.tensor([[1], [2]], device=DEVICE)).cpu(), host.draft(np.array([[1], [2]]))
    )
    for s in (host, dev):
        s.commit([3, 1])
    dev.to_host()
    ids = np.array([21, 22])
    assert np.array_equal(dev.step(ids), host.step(ids))  # the host path again
    assert np.array_equal(dev.window, host.window) and np.array_equal(dev.position, host.position)
    dev.draft(np.array([[1, 2, 3, 4], [5, 6, 7, 8]]))
    with pytest.raises(ValueError, match="at most max_draft=3"):
        dev.to_device(DEVICE)
    dev.rollback()
    dev.to_device(DEVICE)
    assert dev.state_dict()["position"].tolist() == host.position.tolist()


# ------------------------------------------------------------------------------- CUDA only
@pytest.mark.gpu
def test_cuda_graphs_match_host(v41_hasher):
    """Captured step, draft and commit graphs replayed for a whole session == the host stream; the
    capture changes nothing; a replay with another batch size is refused (nothing changes)."""
    b, steps = 4, 40
    host, dev = HashStream(v41_hasher, b), HashStream(v41_hasher, b, max_draft=4)
    prefix = torch.randint(0, 129280, (b, 6), generator=torch.Generator().manual_seed(3)).numpy()
    for s in (host, dev):
        s.feed(prefix)
    step = dev.capture("step", dead_mask=True, starts=True, out_dtype=torch.int32)
    step_plain = dev.capture("step")
    draft = dev.capture("draft", tokens=3)
    commit = dev.capture("commit")
    assert np.array_equal(dev.window, host.window) and np.array_equal(dev.position, host.position)
    g = torch.Generator().manual_seed(4)
    for t in range(steps):
        if t % 5 == 2:
            d = torch.randint(0, 129280, (b, 3), generator=g)
            got = draft(d.cuda()).cpu().numpy()
            assert np.array_equal(got, host.draft(d.numpy())), t
            n = torch.randint(0, 4, (b,), generator=g)
            host.commit(n.numpy())
            commit(n.cuda())
        ids = torch.randint(0, 129280, (b,), generator=g)
        dead = torch.rand(b, generator=g) < 0.2
        starts = torch.rand(b, generator=g) < 0.1
        if t % 2:
            got = step(ids.cuda(), dead.cuda(), starts=starts.cuda()).cpu().numpy()
            want = host.step(ids.numpy(), dead.numpy(), starts=starts.numpy())
        else:
            got = step_plain(ids.cuda()).cpu().numpy()
            want = host.step(ids.numpy())
        assert np.array_equal(got, want), t
    dev.check()
    assert np.array_equal(dev.window, host.window) and np.array_equal(dev.position, host.position)
    before = dev.state_dict()
    with pytest.raises(ValueError, match="captured for 4 sequences"):
        step_plain(torch.zeros(b - 1, dtype=torch.int64, device="cuda"))
    with pytest.raises(ValueError, match="captured for 4 sequences"):
        draft(torch.zeros(b + 1, 3, dtype=torch.int64, device="cuda"))
    with pytest.raises(ValueError, match="captured without dead_mask"):
        step_plain(torch.zeros(b, dtype=torch.int64, device="cuda"), torch.zeros(b, dtype=torch.bool))
    after = dev.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    dev.to_host()
    host.feed(np.array([[7]] * b))
    dev.feed(np.array([[7]] * b))
    ids = torch.arange(b)
    assert np.array_equal(step_plain(ids.cuda()).cpu().numpy(), host.step(ids.numpy()))  # re-uploaded
    dev.to_device("cpu")  # the state leaves the captured tensors: the graph refuses
    with pytest.raises(RuntimeError, match="capture the graph again"):
        step_plain(ids.cuda())


@pytest.mark.gpu
def test_cuda_step_draft_commit_do_not_sync(v41_hasher):
    """A step, a draft and a commit on CUDA (with `out` given) sync nothing with the host."""
    b = 256
    s = HashStream(v41_hasher, b)
    ids = torch.randint(0, 129280, (b,), device="cuda")
    out = torch.empty((b, 2, 24), dtype=torch.int64, device="cuda")
    drafts = torch.randint(0, 129280, (b, 4), device="cuda")
    d_out = torch.empty((b, 4, 2, 24), dtype=torch.int64, device="cuda")
    n = torch.randint(0, 5, (b,), device="cuda")
    s.step(ids, out=out)  # moves the state there, compiles
    s.draft(drafts, out=d_out)
    s.commit(n)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            s.step(ids, out=out)
            s.draft(drafts, out=d_out)
            s.commit(n)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    s.check()
