"""engram.distributed.launch on a machine that looks like the GPU machine (torch.cuda.is_available and
device_count patched in this process): the backend follows where the job's tensors live, not what the
machine has. A CPU job gets gloo beside a GPU (the suite's multi-process tests use CPU tensors, and
NCCL with two ranks on one GPU failed or hung there); CUDA ranks get NCCL only with a GPU each, and
more local ranks than GPUs is one ValueError naming the numbers and the fix before any process group
exists. The commands that start ranks (`engram train --distributed`, `engram hf-train
--distributed`) and `fully_shard_backbone`'s default mesh are checked to take that rule's device."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import gloo_ranks
from engram.distributed import Backend, init_distributed, rank_backend

CPU = torch.device("cpu")


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """Make this process's torch see `count` CUDA devices (0: none)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.fixture
def keep_threads():
    """init_distributed sets this process's torch threads: put them back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _ranks_env(monkeypatch: pytest.MonkeyPatch, rank: int, world: int) -> None:
    """torchrun's environment of rank `rank` of `world` ranks, all on this node."""
    gloo_ranks.one_rank_env(monkeypatch)
    for k, v in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world}.items():
        monkeypatch.setenv(k, str(v))


def _no_group_started(monkeypatch: pytest.MonkeyPatch) -> list:
    """Record init_process_group / set_device calls instead of making them (calls: (name, args, kwargs))."""
    calls: list = []

    def record(name):
        def call(*args, **kwargs):
            calls.append((name, args, kwargs))
            raise RuntimeError(f"stopped at {name}")

        return call

    monkeypatch.setattr(dist, "init_process_group", record("init_process_group"))
    monkeypatch.setattr(torch.cuda, "set_device", record("set_device"))
    return calls


def test_rank_backend_follows_the_device_not_the_machine(monkeypatch):
    _gpus(monkeypatch, 1)
    for device in ("cpu", CPU):
        assert rank_backend(device, 1, 2) == (Backend.GLOO, CPU)  # two CPU ranks beside one GPU: gloo
    assert rank_backend("cuda", 0, 1) == (Backend.NCCL, torch.device("cuda", 0))
    with pytest.raises(ValueError) as e:
        rank_backend("cuda", 1, 2)
    msg = str(e.value)
    assert "device 'cuda' with 2 ranks on this node but 1 GPU(s)" in msg
    assert "torchrun --nproc_per_node 1" in msg and "device 'cpu', gloo" in msg
    with pytest.raises(
        ValueError, match=r"device 'cuda:3': each rank takes the GPU of its LOCAL_RANK.*'cuda'"
    ):
        rank_backend("cuda:3", 0, 1)
    with pytest.raises(ValueError, match=r"device 'gpu' is not a device: give 'cpu' \(gloo\) or 'cuda'"):
        rank_backend("gpu", 0, 1)
    with pytest.raises(ValueError, match=r"device 'meta': ranks run on 'cpu' \(gloo\) or 'cuda'"):
        rank_backend("meta", 0, 1)
    with pytest.raises(TypeError, match="got int"):
        rank_backend(0, 0, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="LOCAL_RANK=2 with 2 local ranks"):
        rank_backend("cpu", 2, 2)
    _gpus(monkeypatch, 2)
    assert rank_backend("cuda", 1, 2) == (Backend.NCCL, torch.device("cuda", 1))  # a GPU per rank
    _gpus(monkeypatch, 0)
    assert rank_backend("cpu", 0, 1) == (Backend.GLOO, CPU)
    with pytest.raises(ValueError, match=r"device 'cuda' but torch sees no CUDA device here: .*device 'cpu'"):
        rank_backend("cuda", 0, 1)


def test_a_cpu_job_on_a_gpu_machine_starts_gloo(monkeypatch, keep_threads):
    """One rank in this process, one GPU visible: the default (and device='cpu') is a gloo group."""
    _gpus(monkeypatch, 1)
    gloo_ranks.one_rank_env(monkeypatch)
    env = init_distributed()
    try:
        assert (env.backend, env.device, dist.get_backend()) == (Backend.GLOO, CPU, "gloo")
    finally:
        dist.destroy_process_group()


def test_cuda_ranks_beyond_the_gpus_refused_before_any_group(monkeypatch):
    """Rank 1 of 2 on a node of one GPU: device 'cuda' (or backend 'nccl', whose device is cuda) is a
    ValueError before set_device or init_process_group; a backend the device does not take is refused
    with the fix; with a GPU each, the rank would start NCCL on its own GPU."""
    _gpus(monkeypatch, 1)
    _ranks_env(monkeypatch, 1, 2)
    calls = _no_group_started(monkeypatch)
    for kw in ({"device": "cuda"}, {"backend": "nccl"}, {"backend": Backend.NCCL, "device": "cuda"}):
        with pytest.raises(ValueError, match="with 2 ranks on this node but 1 GPU"):
            init_distributed(**kw)
    with pytest.raises(
        ValueError, match=r"backend 'nccl' with ranks on cpu: .*leave backend out .*give device cuda"
    ):
        init_distributed("nccl", device="cpu")
    assert calls == []
    _gpus(monkeypatch, 2)
    with pytest.raises(ValueError, match=r"backend 'gloo' with ranks on cuda: nccl carries cuda tensors"):
        init_distributed("gloo", device="cuda")
    assert calls == []
    with pytest.raises(RuntimeError, match="stopped at set_device"):
        init_distributed(device="cuda")
    assert calls == [("set_device", (torch.device("cuda", 1),), {})]


def test_engram_train_distributed_trains_on_the_cpu_beside_a_gpu(cfg_file, monkeypatch, keep_threads):
    """`engram train --distributed` (a 1-rank group in this process, one GPU visible): its model is built
    on the CPU under a gloo group."""
    from engram.apps.lm import train_distributed
    from engram.cli import main

    _gpus(monkeypatch, 1)
    gloo_ranks.one_rank_env(monkeypatch)
    seen = []

    def build(*args, **kw):
        seen.append((kw["device"], dist.get_backend()))
        raise ValueError("stopped before training")

    monkeypatch.setattr("engram.apps.lm.train.prepare_data", lambda cfg: None)
    monkeypatch.setattr(train_distributed, "build_distributed_model", build)
    run = ["train", "--config", str(cfg_file), "--distributed", "--out", str(cfg_file.parent / "r")]
    assert main([*run, "--device", "cpu"]) == 2
    assert seen == [(CPU, "gloo")] and not dist.is_initialized()
    # auto: the GPU only when every rank of the node has one of its own, else the CPU (gloo)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: seen.append("init"))
    from engram.cli.options import device_from_args

    args = type("A", (), {"device": "auto", "dtype": "float32"})()
    assert device_from_args(args, distributed=True)[0] == CPU
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert device_from_args(args, distributed=True)[0] == torch.device("cuda", 0)


@pytest.fixture
def cfg_file(corpus, tmp_path):
    import json

    from training_setup import tiny_cfg

    path = tmp_path / "train.json"
    path.write_text(json.dumps(tiny_cfg(corpus).to_dict()))
    return path


@pytest.fixture
def hf_inputs(tmp_path):
    """An HF folder and a corpus file as far as hf-train's options check them (never loaded here)."""
    folder = tmp_path / "model"
    folder.mkdir()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("In the beginning God created the heaven and the earth.\n")
    return ["hf-train", str(folder), "--corpus", str(corpus), "--out", str(tmp_path / "out"), "--no-progress"]


def test_hf_train_distributed_device(hf_inputs, monkeypatch, capsys, keep_threads):
    """`engram hf-train --distributed` beside one GPU: gloo and the CPU with --device cpu (auto's rule:
    test_engram_train_distributed_trains_on_the_cpu_beside_a_gpu); `--device cuda` with 2 local ranks
    is one line naming the numbers and the fix (exit 2), no group started."""
    import engram.apps.hf.train as H
    from engram.cli import main

    pytest.importorskip("transformers")
    _gpus(monkeypatch, 1)
    gloo_ranks.one_rank_env(monkeypatch)
    seen = []

    def train_folder(s, **kw):
        seen.append((kw["device"], kw["distributed"], dist.get_backend()))
        raise ValueError("stopped before training")

    monkeypatch.setattr(H, "train_folder", train_folder)
    assert main([*hf_inputs, "--distributed", "--device", "cpu"]) == 2
    assert "stopped before training" in capsys.readouterr().err
    assert seen == [(CPU, True, "gloo")] and not dist.is_initialized()
    _ranks_env(monkeypatch, 0, 2)
    assert main([*hf_inputs, "--distributed", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "with 2 ranks on this node but 1 GPU(s)" in err, err
    assert "--nproc_per_node 1" in err and len(seen) == 1 and not dist.is_initialized()


def test_hf_train_device_cuda_without_a_gpu(hf_inputs, monkeypatch, capsys):
    """One process, `--device cuda` where torch sees no GPU: one line naming it and the fix (exit 2)."""
    from engram.cli import main

    pytest.importorskip("transformers")
    _gpus(monkeypatch, 0)
    assert main([*hf_inputs, "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.splitlines() == [err]
        and "--device cuda: no CUDA device is visible (torch.cuda.is_available() is False); use --device cpu"
        in err
    )


def test_fully_shard_default_mesh_follows_the_model_beside_a_gpu(monkeypatch):
    """fully_shard_backbone without a mesh, on a model on the CPU, torch's accelerator CUDA (as on the
    GPU machine): the mesh is the CPU's, every parameter stays there (torch's own default mesh, the
    accelerator's, moved the backbone to the GPU and left the tables behind)."""
    pytest.importorskip("transformers")
    from torch.distributed.tensor import DTensor

    import test_distributed_hf as D
    from engram.distributed.hf.fsdp import fully_shard_backbone

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: cuda)
    gloo_ranks.one_rank_env(monkeypatch)
    dist.init_process_group("gloo")
    try:
        model = fully_shard_backbone(D._model(), mode="replicated")
        params = dict(model.named_parameters())
        meshes = {p.device_mesh.device_type for p in params.values() if isinstance(p, DTensor)}
        assert meshes == {"cpu"} and {p.device for p in params.values()} == {CPU}
    finally:
        dist.destroy_process_group()
