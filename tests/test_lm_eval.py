"""lm-evaluation-harness's ``local-completions`` model, unmodified, against a live
``memlm up``: a multiple-choice task defined on local files (a task yaml and a jsonl; no
dataset hub, no network), tokenised by the server's own tokenizer (its /tokenize), whose
log-likelihoods are exactly /score's sums and whose is_greedy follows the memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.openai_fixtures import MODEL, READ_TOKEN, TEXT, LiveServer

ITEMS = [
    {"context": TEXT[: TEXT.index(" interest")], "choices": ["interest rate", "football team"]},
    {"context": "Heavy snow closed schools in the north of", "choices": ["Scotland", "the sea"]},
]
TASK = """\
task: memlm_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: 0
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.mark.slow  # imports lm-evaluation-harness and its stack in a subprocess (~10 s)
@pytest.mark.xdist_group("memlm_up")  # the process of the other tests of the live server
def test_local_completions_loglikelihoods_are_scores_sums(
    memlm_up: LiveServer, tmp_path: Path
) -> None:
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (tmp_path / "memlm_local.yaml").write_text(TASK.format(data=data))
    offline = {
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),  # the json dataset's cache: the test's own
        "OPENAI_API_KEY": READ_TOKEN,  # local-completions' bearer token
    }
    args = f"model={MODEL},base_url={memlm_up.url}/v1/completions,auth_token={READ_TOKEN}"
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions"]
        + ["--model_args", args, "--tasks", "memlm_local", "--include_path", str(tmp_path)]
        + ["--batch_size", "2", "--output_path", str(tmp_path / "out"), "--log_samples"],
        env={**os.environ, **offline},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-5000:]
    assert "Using remote tokenizer" in out  # the server's tokenizer, no download
    [samples] = (tmp_path / "out").rglob("samples_memlm_local_*.jsonl")
    docs = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [d["acc"] for d in sorted(docs, key=lambda d: d["doc_id"])] == [1.0, 1.0]
    read = memlm_up.read()
    seen = {}
    for d in docs:
        for request, (loglikelihood, greedy) in zip(
            d["arguments"].values(), d["filtered_resps"], strict=True
        ):
            context, continuation = request["arg_0"], request["arg_1"]
            ctxlen = len(
                httpx.post(
                    f"{memlm_up.url}/tokenize",
                    json={"prompt": context, "add_special_tokens": False},
                    headers=read,
                ).json()["tokens"]
            )
            score = httpx.post(
                f"{memlm_up.url}/score", json={"text": context + continuation}, headers=read
            ).json()
            assert float(loglikelihood) == sum(score["logprobs"][ctxlen - 1 :])
            seen[continuation] = greedy
    # the memorised continuation is the model's argmax at every token; the others are not
    assert seen == {
        " interest rate": "True",
        " football team": "False",
        " Scotland": "False",
        " the sea": "False",
    }
