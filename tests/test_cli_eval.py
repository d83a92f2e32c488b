"""`memlm eval`'s options reach EvalConfig: --lambda constant|calibrated, --ingest-*."""

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import memlm.corpus
import memlm.encoder
import memlm.evaluate
from memlm.cli import app
from memlm.knnlm import KnnParams


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Replace the evaluation by a recorder of the config it would run."""
    seen: list[Any] = []

    def fake_evaluate(cfg: Any, docs: Any, out: Path, **_: Any) -> dict[str, Any]:
        seen.append(cfg)
        raise SystemExit(0)

    monkeypatch.setattr(memlm.evaluate, "evaluate", fake_evaluate)
    monkeypatch.setattr(memlm.corpus, "load_corpus", lambda name: [])
    monkeypatch.setattr(memlm.encoder.Encoder, "load", classmethod(fake_load([])))
    return seen


@pytest.fixture
def loads(captured: list[Any], monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """How `memlm eval` asked Encoder.load for its model."""
    seen: list[Any] = []
    monkeypatch.setattr(memlm.encoder.Encoder, "load", classmethod(fake_load(seen)))
    return seen


def fake_load(seen: list[Any]) -> Any:
    """Encoder.load recording how it was asked to load (no model is read)."""

    def load(cls: Any, name: str, **kw: Any) -> Any:
        seen.append(("load", name, kw))
        if kw.get("device") == "cuda:7":
            raise memlm.encoder.EncoderError("device 'cuda:7': torch sees no CUDA device")
        return type("Loaded", (), {"device": kw["device"], "precision": kw["precision"]})()

    return load


def test_precision_and_device_reach_the_encoder(
    loads: list[Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MEMLM_PRECISION", raising=False)
    monkeypatch.delenv("MEMLM_DEVICE", raising=False)
    CliRunner().invoke(app, ["eval", "--out", str(tmp_path)])
    assert loads[0] == ("load", "smollm2-135m", {"threads": None, "precision": "auto",
                                                    "device": "auto"})  # fmt: skip
    loads.clear()
    monkeypatch.setenv("MEMLM_PRECISION", "bfloat16")  # the service's settings, honoured
    monkeypatch.setenv("MEMLM_DEVICE", "cpu")
    result = CliRunner().invoke(app, ["eval", "--out", str(tmp_path)])
    assert loads[0][2]["precision"] == "bfloat16" and loads[0][2]["device"] == "cpu"
    assert "on cpu in bfloat16" in result.output
    loads.clear()
    result = CliRunner().invoke(
        app, ["eval", "--out", str(tmp_path), "--precision", "int8", "--device", "cuda:7"]
    )
    assert result.exit_code == 2 and "cuda:7" in result.output


def test_lambda_calibrated_and_ingest_options(captured: list[Any], tmp_path: Path) -> None:
    args = ["eval", "--out", str(tmp_path), "--lambda", "calibrated", "--gate-theta", "0.05"]
    args += ["--ingest-k", "32", "--ingest-temperature", "3", "--ingest-lambda", "0.1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (cfg,) = captured
    assert cfg.lambda_mode == "calibrated" and type(cfg.lambda_mode) is str
    assert cfg.gate_theta == 0.05
    assert cfg.ingest == KnnParams(k=32, temperature=3.0, lmbda=0.1)


def test_lambda_defaults_to_constant(captured: list[Any], tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["eval", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    (cfg,) = captured
    assert cfg.lambda_mode == "constant" and cfg.gate_theta == 0.0
    assert cfg.ingest is None  # MoNIM scores with the interpolation the service would serve
    assert (cfg.k, cfg.temperature, cfg.lmbda, cfg.split) == (None, None, None, None)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lambda", "0.25"], "'0.25' is not one of 'constant', 'calibrated', 'evidence'"),
        (["--gate-theta", "0.1"], "needs --lambda calibrated"),
        (["--lambda", "calibrated", "--gate-theta", "1.5"], "must be in [0, 1)"),
    ],
)
def test_bad_lambda_options_are_refused(
    captured: list[Any], tmp_path: Path, args: list[str], message: str
) -> None:
    result = CliRunner().invoke(
        app, ["eval", "--out", str(tmp_path), *args], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 2
    assert message in result.output
    assert captured == []


def test_fixed_parameters_and_split_file(captured: list[Any], tmp_path: Path) -> None:
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"memory": ["a", "b"], "dev": ["c"], "test": ["d"]}))
    args = ["eval", "--out", str(tmp_path), "--k", "1024", "--temperature", "1"]
    args += ["--lambda-value", "0.25", "--split", str(split)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (cfg,) = captured
    assert (cfg.k, cfg.temperature, cfg.lmbda) == (1024, 1.0, 0.25)
    assert cfg.split == {"memory": ["a", "b"], "dev": ["c"], "test": ["d"]}
    assert cfg.split_file == str(split)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ingest-lambda", "0.1"], "give --ingest-k, --ingest-temperature and --ingest-lambda"),
        (["--k", "2048"], "--k must be in [1, --k-max = 1024]"),
        (["--temperature", "0"], "--temperature must be > 0"),
        (["--lambda-value", "1.5"], "--lambda-value must be in [0, 1]"),
        (["--split", "missing.json"], "cannot read missing.json"),
    ],
)
def test_bad_fixed_or_ingest_options_are_refused(
    captured: list[Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        app, ["eval", "--out", str(tmp_path), *args], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 2
    assert message in result.output
    assert captured == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stride", "512"], "the largest legal stride for context 512 is 511"),
        (["--context", "64", "--stride", "64"], "the largest legal stride for context 64 is 63"),
    ],
)
def test_stride_equal_to_context_is_refused_naming_the_largest_legal_one(
    captured: list[Any], tmp_path: Path, args: list[str], message: str
) -> None:
    result = CliRunner().invoke(
        app, ["eval", "--out", str(tmp_path), *args], env={"COLUMNS": "300"}
    )
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())  # the error box may wrap lines
    assert captured == []
    ok = CliRunner().invoke(app, ["eval", "--out", str(tmp_path), "--stride", "511"])
    assert ok.exit_code == 0 and captured[0].window.stride == 511


def test_stream_options(captured: list[Any], tmp_path: Path) -> None:
    args = ["eval", "--out", str(tmp_path), "--resume", "--no-dedup", "--dev-share", "0.05"]
    args += ["--test-share", "0.04", "--forgetting", "fullmem", "--no-names"]
    args += ["--finetune-lr", "1e-5", "--ood-dir", str(tmp_path), "--ood-tokens", "100"]
    args += ["--encode-shard", "1/2", "--merge", "runs/a", "--merge", "runs/b"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (cfg,) = captured
    assert (cfg.resume, cfg.dedup, cfg.dev_share, cfg.test_share) == (True, False, 0.05, 0.04)
    assert (cfg.forgetting_policies, cfg.names, cfg.finetune_lr) == (("fullmem",), False, 1e-5)
    assert (cfg.ood_dir, cfg.ood_tokens, cfg.encode_shard) == (str(tmp_path), 100, (1, 2))
    assert cfg.merge_from == ("runs/a", "runs/b")


def test_stream_defaults(captured: list[Any], tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["eval", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    (cfg,) = captured
    assert (cfg.resume, cfg.dedup, cfg.names, cfg.finetune_lr, cfg.ood_dir) == (
        False,
        True,
        True,
        None,
        None,
    )
    assert cfg.forgetting_policies == ("fullmem", "monim") and cfg.encode_shard is None
    assert cfg.merge_from == ()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dev-share", "0"], "must be in (0,"),
        (["--test-share", "0.6"], "must be in (0,"),
        (["--finetune-lr", "2"], "must be in (0, 1)"),
        (["--encode-shard", "2/2"], "expected I/N with 0 <= I < N"),
        (["--encode-shard", "1"], "expected I/N with 0 <= I < N"),
    ],
)
def test_bad_stream_options_are_refused(
    captured: list[Any], tmp_path: Path, args: list[str], message: str
) -> None:
    result = CliRunner().invoke(app, ["eval", "--out", str(tmp_path), *args])
    assert result.exit_code == 2 and not captured
    assert message in " ".join(result.output.split())


def test_ood_dir_without_the_corpora_is_refused(tmp_path: Path) -> None:
    from memlm.evaluate.ood import OodError, load_ood

    with pytest.raises(OodError, match="needs a gensim wheel"):
        load_ood(tmp_path, None, 100, None)  # type: ignore[arg-type]


def test_memory_url_reaches_the_config(captured: list[Any], tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["eval", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    url = "milvus://127.0.0.1:19530/parity?index=hnsw"
    result = CliRunner().invoke(app, ["eval", "--out", str(tmp_path), "--memory-url", url])
    assert result.exit_code == 0, result.output
    assert [c.memory_url for c in captured] == [None, url]


def test_a_bad_memory_url_is_refused(captured: list[Any], tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        ["eval", "--out", str(tmp_path), "--memory-url", "milvus://h:1/9bad"],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 2
    assert "Milvus collection name" in result.output
    assert captured == []


def test_memory_url_embedded_runs_on_a_server_of_its_own(
    captured: list[Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--memory-url embedded: a server under OUT/milvus for the run, stopped after it."""
    import memlm.memory.embedded

    started: list[Path] = []
    stopped: list[bool] = []

    class Server:
        url = "milvus://127.0.0.1:19777"
        start_seconds = 1.0

        def stop(self) -> None:
            stopped.append(True)

    def start(base_dir: Path, **_: Any) -> Server:
        started.append(base_dir)
        return Server()

    monkeypatch.setattr(memlm.memory.embedded, "start_embedded", start)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["eval", "--out", str(out), "--memory-url", "embedded"])
    assert result.exit_code == 0, result.output
    assert started == [out / "milvus"] and stopped == [True]
    assert captured[0].memory_url == "milvus://127.0.0.1:19777/memlm_eval"


def test_a_spread_budget_reaches_the_consolidation(captured: list[Any], tmp_path: Path) -> None:
    from memlm.evaluate.config import consolidation_of

    args = ["eval", "--out", str(tmp_path), "--policies", "fullmem+budget", "--budget", "900"]
    result = CliRunner().invoke(app, [*args, "--budget-criterion", "spread"])
    assert result.exit_code == 0, result.output
    cons = consolidation_of("fullmem+budget", captured[0])
    assert cons is not None and (cons.budget, cons.criterion, cons.recent) == (900, "spread", 0.0)
    result = CliRunner().invoke(
        app,
        [
            *args,
            "--budget-criterion",
            "spread",
            "--budget-recent",
            "0.6",
            "--spread-rank",
            "oldest",
        ],
    )
    cons = consolidation_of("fullmem+budget", captured[1])
    assert cons is not None and cons.recent == 0.6 and cons.spread_recent == 0.6
    assert cons.within == "oldest"
    result = CliRunner().invoke(
        app, [*args, "--budget-criterion", "newest"], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 2 and "spread" in result.output and len(captured) == 2
