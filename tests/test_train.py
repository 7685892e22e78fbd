from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from cli_setup import CPU
from engram.apps.lm.data import load_corpus, split_documents
from engram.apps.lm.evaluation import MAX_LOSS, perplexity
from engram.apps.lm.train import (
    DEFAULT_ENGRAM,
    TableOptimizer,
    TrainConfig,
    Trainer,
    build_model,
    evaluate,
    latest_checkpoint,
    load_trained_model,
    prepare_data,
)
from engram.device import Precision
from engram.model.lm import EngramLM
from engram.model.optim import SparseRowAdagrad
from engram.model.sinkhorn import SparseSinkhorn
from training_setup import tiny_cfg


@pytest.fixture(scope="module")
def data(corpus):
    return prepare_data(tiny_cfg(corpus))


def test_corpus_split(corpus):
    docs = load_corpus(corpus)
    train, held = split_documents(docs)
    assert len(docs) == 12 and len(held) == 1 and not {d.name for d in train} & {d.name for d in held}
    kjv_train, kjv_held = split_documents(load_corpus())
    assert "Mark" in {d.name for d in kjv_held} and "Genesis" in {d.name for d in kjv_train}


def test_tiny_run_reduces_loss(corpus, data):
    cfg = tiny_cfg(corpus)
    t = Trainer(cfg, data, build_model(cfg, data))
    before = t.evaluate()["loss"]
    t.run()
    after = t.evaluate()["loss"]
    assert after < before - 0.5, (before, after)
    assert [h["step"] for h in t.history if "held_out_loss" in h] == [10, 20, 30]


@pytest.mark.parametrize(
    "optimizers",
    [{}, {"table_optimizer": "sinkhorn"}, {"table_optimizer": "sinkhorn", "embedding_optimizer": "sinkhorn"}],
)
def test_resume_is_exact(corpus, data, tmp_path, optimizers):
    cfg = tiny_cfg(corpus, steps=12, eval_every=0, **optimizers)
    straight = Trainer(cfg, data, build_model(cfg, data))
    straight.run()

    first = Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path)
    first.run(until=6)
    first.save_checkpoint()
    resumed = Trainer(cfg, data, build_model(cfg.replace(seed=99), data), out_dir=tmp_path)  # other init
    resumed.resume_from(latest_checkpoint(tmp_path))
    assert resumed.step == 6
    resumed.run()
    for (name, a), (_, b) in zip(
        straight.model.state_dict().items(), resumed.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert [h["train_loss"] for h in straight.history] == [h["train_loss"] for h in resumed.history]


def test_checkpoint_write_is_atomic(corpus, data, tmp_path, monkeypatch):
    cfg = tiny_cfg(corpus, steps=8, eval_every=0)
    t = Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path)
    t.run(until=2)  # stopping early writes a checkpoint
    good = latest_checkpoint(tmp_path)
    assert good is not None and good.name == "step-0000002"
    t.train_step()
    t.train_step()

    import engram.apps.lm.train as train_mod

    calls = {"n": 0}
    real = train_mod.save_tensors

    def dying_save(path, tensors, *a, **k):  # the process "dies" while writing the optimizer state
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("killed")
        return real(path, tensors, *a, **k)

    monkeypatch.setattr(train_mod, "save_tensors", dying_save)
    with pytest.raises(KeyboardInterrupt):
        t.save_checkpoint()
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == good
    cfg2, _model, state = load_trained_model(tmp_path)
    assert state["step"] == 2 and cfg2 == cfg
    t2 = Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path)
    t2.resume_from(good)
    assert t2.step == 2


def test_keep_last_checkpoints(corpus, data, tmp_path):
    cfg = tiny_cfg(corpus, steps=6, eval_every=0, checkpoint_every=2, keep_checkpoints=2)
    Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path).run()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-0000004", "step-0000006"]


def _retype(path, key, dtype) -> None:
    """Rewrite checkpoint file `path` with tensor `key`'s bytes under another dtype name (same size)."""
    from safetensors.torch import load_file, save_file

    t = load_file(str(path))
    t[key] = t[key].view(dtype)
    save_file(t, str(path))


def test_damaged_checkpoints_are_refused_naming_the_cause(corpus, data, tmp_path):
    cfg = tiny_cfg(corpus, steps=2, eval_every=0)
    Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path).run()
    ckpt = latest_checkpoint(tmp_path)
    key = "engrams.1.wkv.weight"
    _retype(ckpt / "model.safetensors", key, torch.int32)  # same bytes: it would load cast, 0.7 nats worse
    with pytest.raises(
        ValueError, match=rf"model.safetensors: tensor '{key}' has dtype I32, but the model expects F32"
    ):
        load_trained_model(tmp_path)
    _retype(ckpt / "model.safetensors", key, torch.float32)
    load_trained_model(tmp_path)
    from safetensors.torch import load_file, save_file

    t = load_file(str(ckpt / "model.safetensors"))
    t[key][0, 0] = float("nan")
    save_file(t, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"tensor '{key}': 1 of its \d+ values are NaN or Inf"):
        load_trained_model(tmp_path)
    (tmp_path / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes())
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors").symlink_to(tmp_path / "model.safetensors")  # data from outside the folder
    with pytest.raises(
        ValueError, match=r"'model.safetensors', a symlink to .* outside the checkpoint folder"
    ):
        load_trained_model(tmp_path)


def test_resume_refuses_optimizer_state_that_does_not_fit(corpus, data, tmp_path):
    """A transposed `exp_avg` used to load into AdamW without a word and fail inside torch.optim.adam at
    the first resumed step: every optimizer tensor is checked against its parameter at load."""
    import re

    from safetensors.torch import load_file, save_file

    cfg = tiny_cfg(corpus, steps=4, eval_every=0)
    Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path).run(until=2)
    ckpt = latest_checkpoint(tmp_path)
    file = ckpt / "optimizer.safetensors"
    good = load_file(str(file))
    dense = next(
        k
        for k, v in good.items()
        if k.startswith("dense.") and k.endswith(".exp_avg") and v.shape[0] != v.shape[-1]
    )
    rows, cols = good[dense].shape
    cases = {  # damage -> what the error says
        "transposed": (
            {dense: good[dense].t().contiguous()},
            rf"tensor '{dense}' has shape \({cols}, {rows}\) .* \(shape \({rows}, {cols}\)\) needs a float "
            rf"tensor of shape \({rows}, {cols}\); the checkpoint is damaged",
        ),
        "sparse transposed": (
            {"table.0.exp_avg": good["table.0.exp_avg"].t().contiguous()},
            r"tensor 'table.0.exp_avg' has shape \(8, \d+\)",
        ),
        "int momentum": (
            {dense.replace("exp_avg", "exp_avg_sq"): good[dense].to(torch.int32)},
            re.escape(
                f"tensor '{dense.replace('exp_avg', 'exp_avg_sq')}' has shape ({rows}, {cols}) and dtype torch.int32"
            ),
        ),
        "float step count": (
            {"table.0.step": good["table.0.step"].float()},
            r"tensor 'table.0.step' .* needs a int tensor",
        ),
        "foreign parameter": (
            {"dense.999.exp_avg": good[dense].clone()},
            r"tensor 'dense.999.exp_avg' is of parameter 999, which the dense optimizer does not have",
        ),
        "foreign name": ({"momentum": good[dense].clone()}, r"tensor 'momentum' is not named <optimizer>"),
    }
    for change, msg in cases.values():
        save_file(good | change, str(file))
        with pytest.raises(ValueError, match=re.escape(str(file)) + ": " + msg):
            Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path).resume_from(ckpt)
        with pytest.raises(ValueError, match="no intact checkpoint"):  # skipped as damaged, none left
            Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path).resume_latest()
    missing = {k: v for k, v in good.items() if k != dense}
    save_file(missing, str(file))
    with pytest.raises(ValueError, match=r"has stored state \['exp_avg_sq', 'step'\], but AdamW keeps"):
        Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path).resume_from(ckpt)
    save_file(good, str(file))
    t = Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path)
    t.resume_from(ckpt)
    t.run()
    assert t.step == 4


def test_resume_refuses_a_step_beyond_the_runs_steps(corpus, data, tmp_path):
    cfg = tiny_cfg(corpus, steps=4, eval_every=0)
    Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path).run(until=3)
    short = cfg.replace(steps=2)
    with pytest.raises(
        ValueError, match=r"step-0000003 is at step 3, beyond this run's 2 total steps; resume with --steps 3"
    ):
        Trainer(short, data, build_model(short, data), out_dir=tmp_path).resume_latest()


def test_resume_skips_damaged_checkpoints(corpus, data, tmp_path, capsys):
    from engram.cli import main

    cfg = tiny_cfg(corpus, steps=6, eval_every=0, checkpoint_every=2, keep_checkpoints=3)
    Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path).run()
    root = tmp_path / "checkpoints"
    assert [p.name for p in sorted(root.iterdir())] == ["step-0000002", "step-0000004", "step-0000006"]
    model = root / "step-0000006" / "model.safetensors"
    os.truncate(model, model.stat().st_size - 100)  # killed while copying
    _retype(root / "step-0000004" / "model.safetensors", "engrams.1.wkv.weight", torch.int32)
    t = Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path)
    path, skipped = t.resume_latest()
    assert path == root / "step-0000002" and t.step == 2
    assert [p.name for p, _ in skipped] == ["step-0000006", "step-0000004"]
    assert "truncated" in skipped[0][1] and "has dtype I32, but the model expects F32" in skipped[1][1]
    # a checkpoint of another config is an error, not skipped
    other = Trainer(cfg.replace(lr=1.0), data, build_model(cfg, data), out_dir=tmp_path)
    with pytest.raises(ValueError, match="another training config"):
        other.resume_latest()
    # the command says what it skipped, resumes, and rewrites the damaged ones as it passes them
    conf = tmp_path / "train.json"
    conf.write_text(json.dumps(cfg.to_dict()))
    args = ["train", "--config", str(conf), "--out", str(tmp_path), "--resume", "--no-progress", "--json"]
    args += CPU
    assert main(args) == 0
    err = capsys.readouterr().err
    assert f"skipped damaged checkpoint {root / 'step-0000006'}: " in err and "truncated" in err
    assert f"skipped damaged checkpoint {root / 'step-0000004'}: " in err
    assert f"resumed from {root / 'step-0000002'} at step 2" in err
    assert load_trained_model(tmp_path)[2]["step"] == 6
    # nothing intact: one clear error naming each checkpoint and why
    for p in root.iterdir():
        (p / "state.json").write_text("{")
    with pytest.raises(ValueError, match=r"no intact checkpoint in .*step-0000006: .*not valid JSON"):
        Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path).resume_latest()
    assert main(args) == 2
    assert capsys.readouterr().err.startswith("engram train: error: no intact checkpoint")


def test_resume_without_a_checkpoint_refused(corpus, tmp_path, capsys):
    """`--resume` where --out holds no checkpoint (a mistyped --out) used to train from the start: one
    line naming the folder looked in, exit 2, nothing written; `--resume-if-possible` starts afresh
    there with a notice, and continues a run where there is one."""
    from engram.cli import main

    cfg = tiny_cfg(corpus, steps=4, eval_every=0)
    conf = tmp_path / "train.json"
    conf.write_text(json.dumps(cfg.to_dict()))
    out = tmp_path / "typo"
    base = ["train", "--config", str(conf), "--out", str(out), "--no-progress", "--json", *CPU]
    assert main([*base, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"engram train: error: --resume: {out / 'checkpoints'} holds no checkpoint to resume from: check "
        "--out (the folder of the run to continue), or give --resume-if-possible to start afresh where "
        "there is none"
    )
    assert not out.exists()
    assert main([*base, "--resume-if-possible", "--until", "2"]) == 0
    assert f"no checkpoint in {out / 'checkpoints'}: training from the start" in capsys.readouterr().err
    assert main([*base, "--resume-if-possible"]) == 0
    captured = capsys.readouterr()
    assert f"resumed from {out / 'checkpoints' / 'step-0000002'} at step 2" in captured.err
    assert json.loads(captured.out.strip().splitlines()[-1])["step"] == 4
    with pytest.raises(SystemExit):  # one or the other
        main([*base, "--resume", "--resume-if-possible"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_stale_temporary_folders_are_removed(corpus, data, tmp_path, capsys):
    import subprocess

    from engram.apps.lm.train import remove_stale_tmp
    from engram.cli import main

    dead = subprocess.Popen(["true"])
    dead.wait()
    root = tmp_path / "checkpoints"
    stale = root / f".tmp-step-0000004-{dead.pid}"
    live = root / f".tmp-step-0000004-{os.getpid()}"
    for p in (stale, live):
        p.mkdir(parents=True)
        (p / "model.safetensors").write_bytes(b"half")
    assert remove_stale_tmp(tmp_path) == [
        (stale, f"left by process {dead.pid}, which is gone (a checkpoint write interrupted)")
    ]
    assert not stale.exists() and live.exists()
    stale.mkdir()
    cfg = tiny_cfg(corpus, steps=2, eval_every=0)
    conf = tmp_path / "train.json"
    conf.write_text(json.dumps(cfg.to_dict()))
    argv = ["train", "--config", str(conf), "--out", str(tmp_path), "--no-progress", "--json", *CPU]
    assert main(argv) == 0
    assert f"removed {stale}: left by process {dead.pid}, which is gone" in capsys.readouterr().err
    assert not stale.exists()


def test_masked_engram_equals_baseline_path(corpus, data):
    cfg = tiny_cfg(corpus)
    model = build_model(cfg, data)
    with torch.no_grad():  # make Engram's contribution non-zero
        for m in model.engrams.values():
            m.wkv.weight.normal_(std=0.5)
    base = EngramLM(model.config.without_engram())
    base.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("engrams.")})
    x = torch.from_numpy(data.held_out.ids[None, :32])
    rows = data.held_rows[None, :32]
    ref = base(x)
    assert not torch.allclose(model(x, rows), ref)
    assert torch.equal(model(x, rows, engram_scale=0.0), ref)
    dead = torch.ones(1, 32, dtype=torch.bool)  # every gate 0: Engram passes the streams through
    assert torch.allclose(model(x, rows, dead_mask=dead), ref, atol=1e-6)
    full = evaluate(model, data.held_out, data.held_rows, 32, engram_scale=0.0)
    assert full["loss"] == pytest.approx(evaluate(base, data.held_out, None, 32)["loss"], abs=1e-6)


def test_baseline_shares_backbone_init(corpus, data):
    cfg = tiny_cfg(corpus)
    a, b = build_model(cfg, data, with_engram=False), build_model(cfg, data, with_engram=True)
    sb = b.state_dict()
    for k, v in a.state_dict().items():
        assert torch.equal(v, sb[k]), k
    assert b.num_params()["total"] > a.num_params()["total"]
    assert b.num_params()["activated"] < a.num_params()["total"] * 1.2


def test_eval_per_category(corpus, data):
    cfg = tiny_cfg(corpus)
    res = evaluate(build_model(cfg, data), data.held_out, data.held_rows, 32)
    assert set(res["per_category"]) == {"text"} and res["tokens"] > 1000
    assert np.isfinite(res["loss"]) and res["ppl"] == pytest.approx(np.exp(res["loss"]))


def test_config_file_round_trip_and_errors(tmp_path):
    cfg = TrainConfig(steps=7, engram=DEFAULT_ENGRAM.replace(layer_ids=(1, 2)), table_optimizer="adagrad")
    assert cfg.table_optimizer is TableOptimizer.ADAGRAD and cfg.engram.layer_ids == (1, 2)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert json.loads(path.read_text())["table_optimizer"] == "adagrad"
    back = TrainConfig.from_file(path)
    assert back == cfg and back.engram == cfg.engram and back.table_optimizer is TableOptimizer.ADAGRAD
    baseline = cfg.replace(engram=None)
    assert TrainConfig.from_dict(json.loads(json.dumps(baseline.to_dict()))) == baseline
    with pytest.raises(ValueError, match="unknown training config keys"):
        TrainConfig.from_dict({"stepz": 3})
    with pytest.raises(ValueError, match=r"engram.layer_ids=\(9,\) must name layers of the 4-layer model"):
        TrainConfig(engram=DEFAULT_ENGRAM.replace(layer_ids=(9,)))
    with pytest.raises(ValueError, match=r"table_optimizer='sgd': use one of 'adam', 'adagrad'"):
        TrainConfig(table_optimizer="sgd")
    with pytest.raises(
        ValueError, match=r"engram.hidden_size=128.*dim=64.*replace\(hidden_size=64, hc_mult=1\)"
    ):
        TrainConfig(dim=64)
    with pytest.raises(TypeError, match="engram must be an EngramConfig or None"):
        TrainConfig(engram=True)


def test_table_optimizer_enum(corpus, data):
    cfg = tiny_cfg(corpus, table_optimizer="adagrad")
    assert isinstance(Trainer(cfg, data, build_model(cfg, data)).table_opt, SparseRowAdagrad)


@pytest.mark.parametrize("tie", [True, False])
def test_v41_recipe_sinkhorn_for_tables_embedding_and_head(corpus, data, tie):
    """table_optimizer / embedding_optimizer 'sinkhorn': the tables, the token embedding and the LM head
    take SparseSinkhorn (the embedding and head at lr), every other parameter AdamW; the loss falls."""
    cfg = tiny_cfg(corpus, table_optimizer="sinkhorn", embedding_optimizer="sinkhorn", tie_embeddings=tie)
    t = Trainer(cfg, data, build_model(cfg, data))
    m = t.model
    embed = [m.embed.weight] + ([] if tie else [m.head.weight])
    assert isinstance(t.table_opt, SparseSinkhorn) and isinstance(t.embed_opt, SparseSinkhorn)
    assert [p for g in t.embed_opt.param_groups for p in g["params"]] == embed
    adamw = {id(p) for g in t.opt.param_groups for p in g["params"]}
    assert not adamw & {id(p) for p in embed}
    assert len(adamw) + len(embed) == len(t.dense_params)
    before = t.evaluate()["loss"]
    t.run()
    assert t.evaluate()["loss"] < before - 0.5
    assert 0 < t.embed_opt.active_rows(m.embed.weight) <= m.embed.weight.shape[0]
    assert t.embed_opt.param_groups[0]["lr"] == pytest.approx(cfg.lr * t.lr_factor(cfg.steps - 1))
    own = Trainer(cfg.replace(embedding_lr=0.5), data, build_model(cfg, data))
    assert own.embed_opt.param_groups[0]["lr"] == 0.5
    with pytest.raises(ValueError, match="embedding_lr=0"):
        cfg.replace(embedding_lr=0.0)


def test_sinkhorn_embedding_beside_adam_tables(corpus, data):
    """The Sinkhorn embedding is an optimizer of its own: with SparseRowAdam tables it trains too."""
    cfg = tiny_cfg(corpus, steps=8, eval_every=0, embedding_optimizer="sinkhorn")
    t = Trainer(cfg, data, build_model(cfg, data))
    assert isinstance(t.embed_opt, SparseSinkhorn) and not isinstance(t.table_opt, SparseSinkhorn)
    before = t.evaluate()["loss"]
    t.run()
    assert t.evaluate()["loss"] < before


def test_diverged_loss_stops_the_run(corpus, data, tmp_path, capsys):
    """embedding_lr 1e10 ended in OverflowError (math.exp of the held-out loss, 5e10 nats): the run stops
    at the first step whose loss has no finite perplexity, naming the step and the learning rates, before
    any checkpoint of it; through the command line, one line and exit 2."""
    from engram.cli import main

    cfg = tiny_cfg(
        corpus,
        steps=6,
        eval_every=3,
        table_optimizer="sinkhorn",
        embedding_optimizer="sinkhorn",
        embedding_lr=1e10,
    )
    t = Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path / "run")
    with pytest.raises(ValueError, match=r"diverged at step 2 of 6 .*embedding_lr=1e\+10 \(sinkhorn\)"):
        t.run()
    assert t.history == [{"step": 1, "train_loss": t.history[0]["train_loss"]}]
    assert latest_checkpoint(tmp_path / "run") is None
    conf = tmp_path / "c.json"
    conf.write_text(json.dumps(cfg.to_dict()))
    argv = ["train", "--config", str(conf), "--out", str(tmp_path / "cli"), "--no-progress", *CPU]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("engram train: error: the training loss diverged at step 2") and "Traceback" not in err
    )


def test_perplexity_of_a_diverged_loss():
    """A mean loss past log(float64 max) has perplexity inf (math.exp raised OverflowError)."""
    assert perplexity(2.0) == pytest.approx(7.389056)
    assert perplexity(5e10) == math.inf and perplexity(MAX_LOSS + 1e-9) == math.inf
    assert math.isnan(perplexity(math.nan))


def test_old_flat_config_is_refused(corpus, data, tmp_path):
    """A config file or checkpoint of the old flat format (engram: true, engram_* keys) is refused,
    naming the file, never misread."""
    old = {"steps": 6, "engram": True, "engram_layers": [1], "engram_max_ngram": 3, "engram_heads": 2}
    conf = tmp_path / "old.json"
    conf.write_text(json.dumps(old))
    with pytest.raises(ValueError, match=f"{conf}: a training config of the old flat format"):
        TrainConfig.from_file(conf)
    cfg = tiny_cfg(corpus, steps=2, eval_every=0)
    Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path / "run").run()
    ckpt = latest_checkpoint(tmp_path / "run")
    state = json.loads((ckpt / "state.json").read_text())
    state["train_config"] = {k: v for k, v in state["train_config"].items() if k != "engram"} | old
    (ckpt / "state.json").write_text(json.dumps(state))
    msg = rf"{ckpt / 'state.json'}: a training config of the old flat format.*retrain the model"
    with pytest.raises(ValueError, match=msg):
        load_trained_model(tmp_path / "run")
    with pytest.raises(ValueError, match=msg):
        Trainer(cfg, data, build_model(cfg, data)).resume_from(ckpt)


def test_cli_train_resume_and_eval(corpus, tmp_path, capsys):
    from engram.cli import main

    cfg = tiny_cfg(corpus, steps=6, eval_every=0)
    conf = tmp_path / "train.json"
    conf.write_text(json.dumps(cfg.to_dict()))
    out = tmp_path / "run"
    train = ["train", "--config", str(conf), "--out", str(out), "--no-progress", *CPU]
    assert main([*train, "--until", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 3
    assert main(train) == 2  # needs --resume
    capsys.readouterr()
    assert main([*train, "--resume", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 6
    assert main(["eval", "--checkpoint", str(out), "--mask-engram", "--json", *CPU]) == 0
    res = json.loads(capsys.readouterr().out)["results"]
    assert set(res) == {"engram", "engram masked"}
    assert res["engram"]["loss"] != res["engram masked"]["loss"]


def test_hyper_connection_streams(corpus, data):
    from engram.model.lm import HyperConnection

    hc = HyperConnection(3)
    with torch.no_grad():
        hc.mix_logits.copy_(torch.randn(3, 3, generator=torch.Generator().manual_seed(0)))
    m = hc.mix_matrix()  # Sinkhorn, 8 iterations: columns exact (normalised last), rows close
    assert torch.allclose(m.sum(0), torch.ones(3), atol=1e-6) and torch.allclose(
        m.sum(1), torch.ones(3), atol=1e-2
    )
    assert torch.allclose(HyperConnection(3).mix_matrix(), torch.eye(3), atol=0.06)  # near identity at init
    cfg = tiny_cfg(corpus, hc=2, steps=15, eval_every=0)
    d = prepare_data(cfg)
    model = build_model(cfg, d)
    assert model.engrams["1"].hc == 2
    x = torch.from_numpy(d.held_out.ids[None, :32])
    logits, gates = model(x, d.held_rows[None, :32], return_gates=True)
    assert logits.shape == (1, 32, d.vocab_size) and gates[1].shape == (1, 32, 2)
    t = Trainer(cfg, d, model)
    before = t.evaluate()["loss"]
    t.run()
    assert t.evaluate()["loss"] < before - 0.3


def test_untied_head(corpus, data):
    cfg = tiny_cfg(corpus, tie_embeddings=False)
    model = build_model(cfg, data)
    assert model.head is not None
    x = torch.from_numpy(data.held_out.ids[None, :16])
    assert model(x, data.held_rows[None, :16]).shape == (1, 16, data.vocab_size)


def test_demo_end_to_end(corpus, tmp_path):
    from engram.apps.lm.demo import run_demo

    cfg = tiny_cfg(corpus, steps=6, eval_every=3)
    res = run_demo(cfg, seeds=(0, 1), out_dir=tmp_path, progress=False)
    for name in ("report.md", "results.json", "loss.png", "gates.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    s = res["summary"]
    assert len(s["gaps"]) == 2 and s["cost_ratio"] > 0 and s["engram_helps"] in (True, False)
    assert s["baseline"]["params"]["total"] < s["engram"]["params"]["total"]
    assert set(s["per_category"]["text"]) == {"baseline", "engram", "engram_masked"}
    report = (tmp_path / "report.md").read_text()
    assert "baseline - Engram" in report and "| engram |" in report
    assert len(res["gates"]) == 3 and all(len(g["tokens"]) == len(g["gates"]) for g in res["gates"])


def test_deepseek_tokenizer_training(corpus):
    cfg = tiny_cfg(
        corpus, {"engram_vocab_size": (2000, 2000)}, tokenizer="deepseek-v4", steps=3, eval_every=0
    )
    d = prepare_data(cfg)
    assert d.vocab_size == 129281  # the DeepSeek-V4 ids plus the document separator
    assert d.engram_config.compressed_vocab_size == d.compression.size
    t = Trainer(cfg, d, build_model(cfg, d))
    t.run()
    assert np.isfinite(t.evaluate(2048)["loss"])


def test_presets_validate_and_demo_matches():
    from engram.apps.lm.demo import DEMO_CONFIG
    from engram.apps.lm.train import TRAIN_PRESETS

    assert set(TRAIN_PRESETS) == {"tiny", "demo", "small"}
    assert DEMO_CONFIG is TRAIN_PRESETS["demo"] and DEMO_CONFIG.steps == 240
    small = TRAIN_PRESETS["small"].engram
    assert small is not None and small.layer_ids == (1, 4) and small.engram_vocab_size == (60000,) * 3


def test_demo_minutes_budget(corpus, tmp_path, monkeypatch):
    import engram.apps.lm.demo as demo

    monkeypatch.setattr(demo, "_time_steps", lambda cfg, data, device, precision: 0.05)  # a fixed step pair
    cfg = tiny_cfg(corpus, eval_every=0)
    res = demo.run_demo(cfg, seeds=(0,), minutes=0.05, out_dir=tmp_path, progress=False)
    assert res["config"]["steps"] == int(0.05 * 60 / (0.05 * 1 * 1.15))  # 52: the budget decides
    assert res["summary"]["engram_helps"] is None  # one seed: no spread, so no verdict
    assert "unknown with one seed" in (tmp_path / "report.md").read_text()
    with pytest.raises(ValueError, match="give at least"):
        demo.run_demo(cfg, seeds=(0,), minutes=0.001, out_dir=tmp_path, progress=False)
    monkeypatch.undo()
    cpu, fp32 = torch.device("cpu"), Precision.FLOAT32
    assert 0 < demo._time_steps(cfg, prepare_data(cfg), cpu, fp32, n=2) < 10


def test_eval_scans_large_tables_only_with_verify(corpus, data, tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file, save_file

    from engram.cli import main
    from engram.storage import integrity

    cfg = tiny_cfg(corpus, steps=1, eval_every=0)
    Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path).run()
    path = latest_checkpoint(tmp_path) / "model.safetensors"
    t = load_file(str(path))
    t["engrams.1.table.weight"][17, 2] = float("nan")
    save_file(t, str(path))
    assert main(["eval", "--checkpoint", str(tmp_path)]) == 2  # a small table: scanned at load
    assert "tensor 'engrams.1.table.weight': 1 of its" in capsys.readouterr().err
    monkeypatch.setattr(integrity, "SCAN_LIMIT_BYTES", 1024)  # as if the table were large
    with pytest.warns(integrity.UnscannedTableWarning, match="engrams.1.table.weight"):
        load_trained_model(tmp_path)
    assert main(["eval", "--checkpoint", str(tmp_path), "--verify"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("engram eval: error: ") and "at row 17, column 2" in err
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "In the", "--verify"]) == 2
    assert "at row 17, column 2" in capsys.readouterr().err


def test_a_checkpoint_whose_engram_layout_was_edited_is_refused(corpus, data, tmp_path):
    """model.safetensors records the Engram layout's fingerprint: a state.json whose lm_config seed was
    edited (every row hashed with other multipliers) is refused by eval and resume, naming both
    fingerprints; a checkpoint written without the fingerprint still loads."""
    from safetensors.torch import load_file, save_file

    from engram.apps.lm.train import layout_metadata
    from engram.checkpoint.v41 import LAYOUT_FINGERPRINT_KEY

    cfg = tiny_cfg(corpus, steps=2, eval_every=0)
    t = Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path)
    t.run()
    ckpt = t.save_checkpoint()
    want = layout_metadata(t.model.config)[LAYOUT_FINGERPRINT_KEY]
    state_file = ckpt / "state.json"
    state = json.loads(state_file.read_text())
    state["lm_config"]["engram"]["seed"] = 7
    state_file.write_text(json.dumps(state))
    with pytest.raises(ValueError, match=rf"fingerprint {want}.*state\.json.*edited") as e:
        load_trained_model(ckpt)
    assert "model.safetensors" in str(e.value)
    resumed = Trainer(cfg, data, build_model(cfg, data), out_dir=tmp_path)
    with pytest.raises(ValueError, match=want):
        resumed.resume_from(ckpt)
    # written without the fingerprint (an older checkpoint): loads as before
    save_file(load_file(ckpt / "model.safetensors"), ckpt / "model.safetensors", {"format": "pt"})
    assert load_trained_model(ckpt)[1].config.engram.seed == 7
