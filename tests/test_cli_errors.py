"""What `engram` calls a refusal of its input (one line, exit status 2) and what it calls a bug (the
traceback, with a note asking for a report); and refusals of options that were taken silently
(`train --embedding-lr` without the Sinkhorn embedding, `bench --only` names, a benchmark that
could not run)."""

from __future__ import annotations

import json
import textwrap

import pytest

from cli_setup import refused
from engram.apps.lm.train_config import TrainConfig
from engram.cli import build_parser, main


# ------------------------------------------------------------------------------------------- refusal or bug
def test_a_type_error_inside_our_code_is_a_bug(monkeypatch, capsys):
    """A TypeError the interpreter raises inside engram's code (here: a result that is None where a
    dict is read) was printed as `error: ...`, exit 2, as if the input were wrong: it is a bug."""
    from engram.addressing.layout import Layout

    monkeypatch.setattr(Layout, "to_dict", lambda self: None)  # cmd_layout then reads d["layers"]
    with pytest.raises(TypeError, match="not subscriptable") as e:
        main(["layout", "--preset", "tiny"])
    assert any("internal error" in n and "please report" in n for n in e.value.__notes__)
    assert "error:" not in capsys.readouterr().err


def test_a_type_error_from_a_library_is_a_bug(monkeypatch):
    """A TypeError raised outside engram's modules (a library refusing what our code passed it) too."""
    import engram.cli.addressing as addressing

    def boom(args):
        raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")

    monkeypatch.setattr(addressing, "cmd_layout", boom)  # this test's module: not engram's
    with pytest.raises(TypeError, match="unsupported operand"):
        main(["layout", "--preset", "tiny"])


def test_our_own_type_check_is_a_refusal(monkeypatch, capsys):
    """A TypeError one of engram's checks raises (its message written for the user) stays one line."""
    import engram.cli.addressing as addressing

    monkeypatch.setattr(addressing, "cmd_layout", lambda args: TrainConfig(engram={"layer_ids": [1]}))
    refused(capsys, ["layout", "--preset", "tiny"], "engram must be an EngramConfig or None")


def test_a_value_error_is_a_refusal(monkeypatch, capsys):
    import engram.cli.addressing as addressing

    monkeypatch.setattr(addressing, "cmd_layout", lambda args: TrainConfig(lr=float("nan")))
    refused(capsys, ["layout", "--preset", "tiny"], "lr=nan must be a finite number > 0")


# ------------------------------------------------------------------------------------------- train options
def test_embedding_lr_without_the_sinkhorn_embedding(tmp_path, capsys):
    """--embedding-lr was ignored without --embedding-optimizer sinkhorn: refused, naming the fix."""
    argv = ["train", "--preset", "tiny", "--out", str(tmp_path / "r"), "--embedding-lr", "0.01"]
    refused(capsys, argv, "--embedding-lr 0.01", "'adamw'", "add --embedding-optimizer sinkhorn")
    refused(capsys, [*argv, "--embedding-optimizer", "adamw"], "add --embedding-optimizer sinkhorn")
    with pytest.raises(ValueError, match="embedding_optimizer='adamw' would ignore it"):
        TrainConfig(embedding_lr=0.01)  # a config file is held to the same rule
    TrainConfig(embedding_lr=0.01, embedding_optimizer="sinkhorn")


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [("lr", float("nan"), "lr=nan"), ("table_lr", float("inf"), "table_lr=inf"), ("lr", 0.0, "lr=0.0"),
     ("min_lr_ratio", 1.5, "min_lr_ratio=1.5"), ("grad_clip", float("nan"), "grad_clip=nan"),
     ("weight_decay", -0.1, "weight_decay=-0.1")],
)  # fmt: skip
def test_train_config_rates_are_finite(tmp_path, capsys, field, value, needle):
    """A NaN or infinite learning rate in a config file was taken (and a checkpoint's state.json with
    one read back): refused where the config is made."""
    with pytest.raises(ValueError, match=needle):
        TrainConfig(**{field: value})
    conf = tmp_path / "c.json"
    conf.write_text(json.dumps(TrainConfig().to_dict() | {field: value}))
    refused(capsys, ["train", "--config", str(conf), "--out", str(tmp_path / "r")], str(conf), needle)


def test_embedding_optimizer_help_says_what_it_does():
    """The help said the Sinkhorn embedding goes 'with --table-optimizer sinkhorn', which nothing enforced:
    it is an optimizer of its own (the Trainer builds it beside any table optimizer)."""
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    train = sub.choices["train"]
    (action,) = [a for a in train._actions if a.dest == "embedding_optimizer"]
    assert "with --table-optimizer sinkhorn)" not in action.help
    assert "beside any --table-optimizer" in action.help


# ------------------------------------------------------------------------------------------- bench
def test_bench_unknown_name_with_list(capsys):
    """`bench --only nope --list` listed the whole suite and exited 0."""
    refused(capsys, ["bench", "--only", "nope", "--list"], "unknown benchmark(s) ['nope']", "known: hash")
    refused(capsys, ["bench", "--only", "hash,nope"], "--only hash,nope", "unknown benchmark(s) ['nope']")


def test_bench_list_only(capsys):
    assert main(["bench", "--only", "hash,decode", "--list"]) == 0
    assert [ln.split()[0] for ln in capsys.readouterr().out.splitlines()] == ["hash", "decode"]


def test_bench_named_benchmark_that_cannot_run(tmp_path, capsys):
    """A benchmark asked for by name that cannot run here (no vLLM, no CUDA) exited 0: its row says
    why, and the exit status is 1."""
    (tmp_path / "bench_hash.py").write_text(
        textwrap.dedent(
            """
            def run(**kwargs):
                raise ImportError("bench_hash needs a package this machine lacks")
            """
        )
    )
    assert main(["bench", "--dir", str(tmp_path), "--only", "hash"]) == 1
    out, err = capsys.readouterr()
    assert "hash: skipped (bench_hash needs a package" in out
    assert err.startswith("engram bench: error: --only hash: hash could not run on this machine")
