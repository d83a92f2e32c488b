"""`memlm eval`: the streaming evaluation of memorisation policies."""

from __future__ import annotations

import dataclasses
from enum import StrEnum
from pathlib import Path
from typing import Literal

import typer

from memlm.knnlm.consolidate import DEFAULT_BUDGET_CRITERION, DEFAULT_BUDGET_RECENT
from memlm.knnlm.policy import POLICY_NAMES

IndexKind = Literal["auto", "flat"]
# --memory-url embedded: a Milvus server of the run's own, its collections named
# memlm_eval_<policy>
EMBEDDED = "embedded"
EMBEDDED_PREFIX = "memlm_eval"


class LambdaMode(StrEnum):
    """How test tokens mix the LM and the memory (``--lambda``)."""

    constant = "constant"  # one lambda tuned on dev
    calibrated = "calibrated"  # the NN calibrator trained day by day on dev
    evidence = "evidence"  # lambda per token from the retrieval evidence, fitted on dev
    # what the service's builds serve: the evidence, or max(evidence, calibrator) where
    # that beats it in both views (memlm.calibrator.combined), evening by evening
    served = "served"


def eval_command(
    corpus: str = typer.Option("news", help="'news' (bundled) or a JSONL file"),
    out: Path = typer.Option(Path("runs/eval"), help="output directory"),
    model: str = typer.Option("smollm2-135m", help="bundled model, HF id or local path"),
    days: int | None = typer.Option(None, help="only the first N days of the stream"),
    start: str | None = typer.Option(None, help="skip days before this ISO date"),
    max_docs_per_day: int | None = typer.Option(None, help="ingest at most N documents a day"),
    max_eval_docs_per_day: int | None = typer.Option(2, help="dev and test documents a day (each)"),
    policies: str = typer.Option(
        ",".join(POLICY_NAMES),
        help=f"comma-separated, of: {', '.join(POLICY_NAMES)}, each optionally with +cons "
        "(nightly consolidation) and/or +budget (keep --budget entries); 'bare' always runs",
    ),
    consolidate_sample: int = typer.Option(
        2048, help="+cons policies: stored entries re-tested each night (a rotating window)"
    ),
    budget: int | None = typer.Option(None, help="+budget policies: entries kept after a build"),
    budget_criterion: str = typer.Option(
        DEFAULT_BUDGET_CRITERION,
        help="what a +budget policy retires first: age, usage, redundancy, random, or spread "
        "(every older day thinned to the same size, the newest --budget-recent kept whole)",
    ),
    spread_rank: str = typer.Option(
        "lm",
        help="spread: what goes first within a day: lm (what the LM predicts best), oldest, "
        "usage (fewest hits of its block) or random",
    ),
    budget_recent: float = typer.Option(
        DEFAULT_BUDGET_RECENT,
        min=0.0,
        max=1.0,
        help="spread: the share of --budget kept for the newest entries",
    ),
    delta: float = typer.Option(-1.5, help="MoNIM threshold on log p(x_t)"),
    kl_delta: float = typer.Option(
        -10.0, help="MoNIM(KL) threshold on the key's log p(x_t) (see memlm/knnlm/policy.py)"
    ),
    rand_rate: float | None = typer.Option(None, help="RandMem rate (default: MoNIM's MemRate)"),
    context: int = typer.Option(512, help="window length in tokens"),
    stride: int = typer.Option(256, help="window stride in tokens"),
    batch_size: int = typer.Option(4, help="windows per forward pass"),
    ingest_k: int | None = typer.Option(
        None,
        help="neighbours MoNIM scores with while ingesting; with --ingest-temperature and "
        "--ingest-lambda (default: the interpolation the service would serve)",
    ),
    ingest_temperature: float | None = typer.Option(
        None, help="kNN temperature while ingesting (see --ingest-k)"
    ),
    ingest_lambda: float | None = typer.Option(
        None, help="interpolation weight while ingesting (see --ingest-k)"
    ),
    k: int | None = typer.Option(
        None, help="fixed k for test and ingest scoring (not tuned): outside comparisons"
    ),
    temperature: float | None = typer.Option(None, help="fixed kNN temperature (not tuned)"),
    lambda_value: float | None = typer.Option(None, help="fixed lambda (not tuned)"),
    split: Path | None = typer.Option(
        None,
        help="JSON object of document id lists 'memory', 'dev' and 'test' (each run writes "
        "its own as split.json); replaces the seeded split and the per-day limits",
    ),
    k_max: int = typer.Option(1024, help="neighbours fetched for held-out tokens (tuning grid)"),
    index_kind: IndexKind = typer.Option(
        "auto",
        help="auto (flat, then the memory's index past 50k: IVF-PQ on faiss, the URL's "
        "index option on Milvus) or flat",
    ),
    memory_url: str | None = typer.Option(
        None,
        help="where each policy's memory lives: faiss (default: the files of its work "
        "directory), milvus://host:port/PREFIX[?options] (a collection PREFIX_<policy> each, "
        "dropped first and after the run unless --keep-stores; options as MEMLM_MEMORY_URL's) "
        "or embedded (a Milvus server started under OUT/milvus for the run)",
    ),
    rerank_depth: int | None = typer.Option(
        None,
        min=1,
        help="IVF-PQ candidates each held-out search re-ranks exactly (default max(4 k, 1024))",
    ),
    ingest_rerank_depth: int | None = typer.Option(
        None,
        min=1,
        help="IVF-PQ candidates each search of the policy's decision re-ranks (default 1024)",
    ),
    pointers: int | None = typer.Option(
        None,
        min=1,
        help="follow RetoMaton's pointers: a token searches only when fewer than this many "
        "successors of the last token's neighbours beat the learned distance (default: off)",
    ),
    seed: int = typer.Option(0),
    threads: int | None = typer.Option(None, help="torch threads (default MEMLM_THREADS or cores)"),
    keep_stores: bool = typer.Option(False, help="keep each policy's datastore and index"),
    local_memory: bool = typer.Option(
        False, help="TRIME local memory: earlier tokens of the window join the softmax"
    ),
    long_memory: int = typer.Option(
        0, metavar="SEGMENTS", help="TRIME long-term memory: that many earlier windows too"
    ),
    lambda_mode: LambdaMode = typer.Option(
        LambdaMode.constant,
        "--lambda",
        help="constant (tuned on dev), calibrated (NN calibrator trained day by day on dev), "
        "evidence (lambda per token from the neighbours' distance and agreement, fitted day by "
        "day on dev) or served (what the service's nightly builds serve: the evidence, or "
        "max(evidence, calibrator) where that beats it in both views of the validation tokens)",
    ),
    calibrator_min_tokens: int | None = typer.Option(
        None,
        min=1,
        envvar="MEMLM_CALIBRATOR_MIN_TOKENS",
        help="served only: dev tokens before the calibrator trains (default: the service's)",
    ),
    gate_theta: float = typer.Option(
        0.0, help="calibrated only: skip the search when the retrieval gate's lambda < theta"
    ),
    dev_share: float = typer.Option(0.02, help="share of each day's documents held out as dev"),
    test_share: float = typer.Option(0.02, help="share of each day's documents held out as test"),
    dedup: bool = typer.Option(
        True,
        help="drop exact and near-duplicate documents; keep held-out documents that overlap "
        "the memory by more than 5 percent of their 13-grams out of dev and test (--no-dedup: the plans "
        "of the tables made before it)",
    ),
    resume: bool = typer.Option(
        False, help="go on from each policy's last finished day in OUT/work (nothing re-encodes)"
    ),
    merge: list[Path] = typer.Option(
        [],
        "--merge",
        help="an earlier OUT of this same run with other --policies (repeatable): copy its "
        "policies' checkpoints in first, then go on as --resume (one process per core, "
        "one report)",
    ),
    forgetting: str = typer.Option(
        "fullmem,monim", help="policies whose test sets are re-scored at every month's end"
    ),
    names: bool = typer.Option(True, help="name-token accuracy and perplexity"),
    ood_dir: Path | None = typer.Option(
        None,
        help="folder with a gensim wheel and the unpacked bible-kjv (kjv/usr/bin/bible): "
        "out-of-domain perplexity after the stream (memlm/evaluate/ood.py says how to fill it)",
    ),
    ood_tokens: int = typer.Option(6000, help="tokens per out-of-domain corpus"),
    finetune_lr: float | None = typer.Option(
        None,
        help="also run the continual fine-tuning baseline (full weights, one epoch a day, "
        "AdamW at this learning rate, e.g. 1e-5); slow: about 3 forward passes per token",
    ),
    encode_shard: str | None = typer.Option(
        None,
        help="I/N: only encode shard I (0-based) of N of the run's texts into the token cache "
        "and stop; N such processes of one thread each, then the same command without it",
    ),
    follow_encode: float | None = typer.Option(
        None,
        min=0.0,
        help="SECONDS: --encode-shard processes run beside this one; wait up to SECONDS for "
        "each document they have not written yet instead of encoding it (the policies follow "
        "the encode day by day: one core encodes while another ingests)",
    ),
    precision: str = typer.Option(
        "auto",
        envvar="MEMLM_PRECISION",
        help="auto (probed once per processor and model, cached), float32, bfloat16, "
        "float16 (CUDA) or int8 (CPU)",
    ),
    device: str = typer.Option(
        "auto", envvar="MEMLM_DEVICE", help="auto (CUDA when torch sees it), cpu, cuda[:N]"
    ),
) -> None:
    """Stream a corpus day by day through each policy; write report.json, report.md, plots."""
    import datetime as dt
    import json
    import logging

    from memlm.corpus import load_corpus
    from memlm.encoder import WindowConfig
    from memlm.evaluate import EvalConfig, SplitError, TrimeSpec, evaluate
    from memlm.evaluate.harness import ResumeMismatch
    from memlm.evaluate.ood import OodError
    from memlm.knnlm import KnnParams
    from memlm.memory.pointers import PointerConfig

    logging.basicConfig(level=logging.WARNING)
    chosen = [p.strip() for p in policies.split(",") if p.strip() and p.strip() != "bare"]
    from memlm.evaluate.config import policy_parts

    try:
        unknown = sorted(p for p in chosen if policy_parts(p)[0] not in POLICY_NAMES)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--policies") from None
    from memlm.memory.consolidation import CRITERIA, SPREAD_RANKS

    if budget_criterion not in CRITERIA:
        raise typer.BadParameter(
            f"choose one of {', '.join(CRITERIA)}", param_hint="--budget-criterion"
        )
    if spread_rank not in SPREAD_RANKS:
        raise typer.BadParameter(
            f"choose one of {', '.join(SPREAD_RANKS)}", param_hint="--spread-rank"
        )
    if any(policy_parts(p)[2] for p in chosen) and (budget is None or budget < 0):
        raise typer.BadParameter("+budget policies need --budget >= 0", param_hint="--budget")
    if consolidate_sample < 1:
        raise typer.BadParameter("must be >= 1", param_hint="--consolidate-sample")
    if unknown:
        raise typer.BadParameter(
            f"unknown {', '.join(unknown)}; choose from {', '.join(POLICY_NAMES)}",
            param_hint="--policies",
        )
    ingest = (ingest_k, ingest_temperature, ingest_lambda)
    if any(v is not None for v in ingest) and any(v is None for v in ingest):
        raise typer.BadParameter(
            "give --ingest-k, --ingest-temperature and --ingest-lambda together (or none: "
            "the interpolation the service would serve)",
            param_hint="--ingest-k",
        )
    if k is not None and not 1 <= k <= k_max:
        raise typer.BadParameter(f"--k must be in [1, --k-max = {k_max}]", param_hint="--k")
    if temperature is not None and temperature <= 0:
        raise typer.BadParameter("--temperature must be > 0", param_hint="--temperature")
    if lambda_value is not None and not 0.0 <= lambda_value <= 1.0:
        raise typer.BadParameter("--lambda-value must be in [0, 1]", param_hint="--lambda-value")
    try:
        ingest_params = (
            None
            if ingest_k is None or ingest_temperature is None or ingest_lambda is None
            else KnnParams(k=ingest_k, temperature=ingest_temperature, lmbda=ingest_lambda)
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--ingest-k") from exc
    split_ids = None
    if split is not None:
        try:
            split_ids = json.loads(split.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise typer.BadParameter(f"cannot read {split}: {exc}", param_hint="--split") from exc
        if not isinstance(split_ids, dict) or not all(
            isinstance(v, list) and all(isinstance(i, str) for i in v) for v in split_ids.values()
        ):
            raise typer.BadParameter(
                "expected a JSON object of id lists: memory, dev, test", param_hint="--split"
            )
    if not 0.0 <= gate_theta < 1.0 or (gate_theta > 0 and lambda_mode != LambdaMode.calibrated):
        raise typer.BadParameter(
            "--gate-theta must be in [0, 1) and needs --lambda calibrated",
            param_hint="--gate-theta",
        )
    if finetune_lr is not None and not 0.0 < finetune_lr < 1.0:
        raise typer.BadParameter("--finetune-lr must be in (0, 1)", param_hint="--finetune-lr")
    if not (0.0 < dev_share < 0.5 and 0.0 < test_share < 0.5):
        raise typer.BadParameter(
            "--dev-share and --test-share must be in (0, 0.5)", param_hint="--dev-share"
        )
    embedded = memory_url is not None and memory_url.strip() == EMBEDDED
    if memory_url is not None and not embedded:
        from memlm.memory import parse_memory_url

        try:
            parse_memory_url(memory_url)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--memory-url") from None
    shard = None
    if encode_shard is not None:
        i, _, n = encode_shard.partition("/")
        if not (i.isdigit() and n.isdigit() and 0 <= int(i) < int(n)):
            raise typer.BadParameter(
                f"expected I/N with 0 <= I < N, e.g. 0/2; got {encode_shard!r}",
                param_hint="--encode-shard",
            )
        shard = (int(i), int(n))
    try:
        window = WindowConfig(context=context, stride=stride, batch_size=batch_size)
    except ValueError as exc:  # e.g. --stride equal to --context: name the largest legal one
        raise typer.BadParameter(str(exc), param_hint="--stride / --context") from None
    cfg = EvalConfig(
        corpus=corpus,
        model=model,
        window=window,
        days=days,
        start=dt.date.fromisoformat(start) if start else None,
        max_docs_per_day=max_docs_per_day,
        max_eval_docs_per_day=max_eval_docs_per_day,
        seed=seed,
        policies=tuple(chosen),
        delta=delta,
        kl_delta=kl_delta,
        rand_rate=rand_rate,
        ingest=ingest_params,
        k=k,
        temperature=temperature,
        lmbda=lambda_value,
        split=split_ids,
        split_file=None if split is None else str(split),
        k_max=k_max,
        index_kind=index_kind,
        rerank_depth=rerank_depth,
        ingest_rerank_depth=ingest_rerank_depth,
        pointers=None if pointers is None else PointerConfig(min_hits=pointers),
        threads=threads,
        keep_stores=keep_stores,
        trime=TrimeSpec(long_segments=long_memory) if local_memory or long_memory else None,
        lambda_mode=lambda_mode.value,
        gate_theta=gate_theta,
        dev_share=dev_share,
        test_share=test_share,
        dedup=dedup,
        resume=resume,
        merge_from=tuple(str(m) for m in merge),
        forgetting_policies=tuple(p.strip() for p in forgetting.split(",") if p.strip()),
        names=names,
        finetune_lr=finetune_lr,
        ood_dir=None if ood_dir is None else str(ood_dir),
        ood_tokens=ood_tokens,
        encode_shard=shard,
        follow_encode=follow_encode,
        consolidate_sample=consolidate_sample,
        budget=budget,
        budget_criterion=budget_criterion,
        budget_recent=budget_recent,
        spread_rank=spread_rank,
        memory_url=None if embedded else memory_url,
    )
    if calibrator_min_tokens is not None:
        cfg = dataclasses.replace(cfg, calibrator_min_tokens=calibrator_min_tokens)

    from memlm.encoder import Encoder, EncoderError

    try:
        encoder = Encoder.load(model, threads=threads, precision=precision, device=device)
    except EncoderError as exc:
        raise typer.BadParameter(str(exc), param_hint="--precision / --device") from exc
    typer.echo(f"encoder: {model} on {encoder.device} in {encoder.precision}")
    server = None
    if embedded and shard is None:  # (an encode shard writes the token cache only)
        from memlm.memory.embedded import MilvusUnavailable, start_embedded

        try:
            server = start_embedded(out / "milvus")
        except MilvusUnavailable as exc:
            raise typer.BadParameter(str(exc), param_hint="--memory-url") from exc
        cfg = dataclasses.replace(cfg, memory_url=f"{server.url}/{EMBEDDED_PREFIX}")
        typer.echo(f"memory: embedded Milvus at {server.url} ({server.start_seconds:.0f} s)")
    try:
        report = evaluate(cfg, load_corpus(corpus), out, encoder=encoder, echo=typer.echo)
    except SplitError as exc:
        raise typer.BadParameter(str(exc), param_hint="--split") from exc
    except ResumeMismatch as exc:
        raise typer.BadParameter(str(exc), param_hint="--resume / --merge") from exc
    except OodError as exc:
        raise typer.BadParameter(str(exc), param_hint="--ood-dir") from exc
    finally:
        if server is not None:
            server.stop()
    if shard is not None:
        return  # the shard's summary was echoed
    from memlm.evaluate import render_markdown

    typer.echo(render_markdown(report))
    typer.echo(f"wrote {out}/report.json, report.md and plots")


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)
