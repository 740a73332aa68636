"""scripts/evaluate.py on a tiny checkpoint, offline: lm-eval's per-request log-likelihoods are
our model's, the results land beside the checkpoint, and a hub task fails with the offline route.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

from tests.scripts.tiny_checkpoint import write_choice_task

REPO = Path(__file__).resolve().parents[2]

# One long context (> seq_len=64 tokens) checks the left truncation of over-long inputs.
LONG_CONTEXT = " ".join(["the sun is hot and the moon is cold"] * 12) + " and the cat sat on the"
DOCS = [
    {"question": "the cat sat on the", "choices": ["mat", "park", "moon"], "label": 0},
    {"question": "a dog ran in the", "choices": ["park", "mat"], "label": 0},
    {"question": "the sun is hot and the moon is", "choices": ["cold", "hot", "green hills"], "label": 0},
    {"question": "birds fly over the", "choices": ["water", "green hills"], "label": 1},
    {"question": LONG_CONTEXT, "choices": ["mat", "park"], "label": 0},
]
GENERATION_DOCS = [{"question": "the cat sat on the"}, {"question": "a dog"}, {"question": "birds fly"}]
GENERATION_STOP = "park"
ROLLING_DOCS = [{"text": "the sun is hot and the moon is cold"},
                {"text": " ".join(["we drink water when we are thirsty"] * 12)}]  # > 64 tokens


def _local_json_dataset(path: Path, docs: List[dict], cache_dir: Optional[Path] = None) -> str:
    """Writes ``docs`` as JSON lines to ``path``; returns the task-YAML lines that load them."""
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    cache = f"  cache_dir: {cache_dir}\n" if cache_dir else ""
    return f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\n{cache}test_split: test\n"


def _write_generation_and_rolling_tasks(folder: Path) -> None:
    (folder / "tiny_gen.yaml").write_text(_local_json_dataset(folder / "tiny_gen.jsonl", GENERATION_DOCS) + f"""
task: tiny_gen
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: " mat"
generation_kwargs:
  until: ["{GENERATION_STOP}"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    (folder / "tiny_rolling.yaml").write_text(_local_json_dataset(folder / "tiny_rolling.jsonl", ROLLING_DOCS) + """
task: tiny_rolling
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""")


def _offline_env(tmp_path: Path) -> Dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled",
                HF_DATASETS_CACHE=str(tmp_path / "hf_datasets"), OMP_NUM_THREADS="1",
                TOKENIZERS_PARALLELISM="false")


def _evaluate_cli(args: List[str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/evaluate.py", *args], cwd=REPO,
                          env=_offline_env(tmp_path), capture_output=True, text=True, timeout=240)


def _our_continuation_logprob(model, tokenizer, context: str, continuation: str) -> float:
    """Unbatched, unpadded: the last seq_len tokens before each continuation token."""
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    continuation_ids = tokenizer.encode(continuation, add_special_tokens=False)
    # The data is chosen so that splitting the text and splitting the ids agree.
    assert context_ids + continuation_ids == tokenizer.encode(context + continuation, add_special_tokens=False)
    ids = (context_ids + continuation_ids)[-(model.cfg.seq_len + 1):]
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([ids[:-1]])).double(), dim=-1)[0]
    targets = torch.tensor(ids[1:])
    picked = log_probs[torch.arange(len(targets)), targets]
    return float(picked[-len(continuation_ids):].sum())


@pytest.fixture(scope="module")
def evaluated(checkpoint: Path, tmp_path_factory) -> Dict[str, object]:
    """One CLI run on the custom task (each run pays for importing lm-eval in a fresh process)."""
    tmp_path = tmp_path_factory.mktemp("eval_run")
    write_choice_task(tmp_path / "tasks", "tiny_choice", _local_json_dataset(tmp_path / "tiny_choice.jsonl", DOCS))
    _write_generation_and_rolling_tasks(tmp_path / "tasks")
    before = set(checkpoint.glob("eval-*.json"))
    proc = _evaluate_cli([f"checkpoint={checkpoint}", "tasks=[tiny_choice,tiny_gen,tiny_rolling]",
                          f"include_path={tmp_path / 'tasks'}", "batch_size=2", "log_samples=true",
                          "device=cpu"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"proc": proc, "written": sorted(set(checkpoint.glob("eval-*.json")) - before)}


def test_custom_task_log_likelihoods_are_our_models(checkpoint: Path, evaluated) -> None:
    from evaluation.checkpoint import load_checkpoint_for_inference

    (results_file,) = evaluated["written"]
    loaded = load_checkpoint_for_inference(checkpoint, device="cpu")
    samples_file = results_file.with_name(results_file.stem + "-samples.jsonl")
    samples = [s for s in map(json.loads, samples_file.read_text().splitlines())
               if s["task"] == "tiny_choice"]
    assert sorted(s["doc_id"] for s in samples) == list(range(len(DOCS)))
    correct = 0
    for sample in samples:
        doc = DOCS[sample["doc_id"]]
        ours = []
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            assert context == doc["question"] and continuation.strip() in doc["choices"]
            reported = response[0][0]
            expected = _our_continuation_logprob(loaded.model, loaded.tokenizer, context, continuation)
            assert reported == pytest.approx(expected, abs=1e-4), (sample["doc_id"], continuation)
            ours.append(expected)
        picked_label = max(range(len(ours)), key=ours.__getitem__) == doc["label"]
        assert sample["acc"] == float(picked_label)
        correct += int(picked_label)
    record = json.loads(results_file.read_text())
    assert record["metrics"]["eval/tiny_choice/acc"] == pytest.approx(correct / len(DOCS))


def _samples(results_file: Path, task: str) -> List[dict]:
    lines = results_file.with_name(results_file.stem + "-samples.jsonl").read_text().splitlines()
    return sorted((s for s in map(json.loads, lines) if s["task"] == task), key=lambda s: s["doc_id"])


def test_generation_task_decodes_greedily_with_our_model(checkpoint: Path, evaluated) -> None:
    from evaluation.checkpoint import load_checkpoint_for_inference

    loaded = load_checkpoint_for_inference(checkpoint, device="cpu")
    tokenizer, model = loaded.tokenizer, loaded.model
    samples = _samples(evaluated["written"][0], "tiny_gen")
    assert len(samples) == len(GENERATION_DOCS)
    for sample, doc in zip(samples, GENERATION_DOCS):
        ids = tokenizer.encode(doc["question"], add_special_tokens=False)
        new: List[int] = []
        with torch.no_grad():
            for _ in range(8):
                new.append(int(model(torch.tensor([ids + new]))[0, -1].argmax()))
        text = tokenizer.decode(new)
        for stop in (GENERATION_STOP, tokenizer.eos_token):
            text = text.split(stop)[0]
        assert sample["resps"] == [[text]]
    assert samples[0]["resps"] == [[" mat"]] and samples[0]["exact_match"] == 1.0


def test_rolling_log_likelihoods_are_our_models(checkpoint: Path, evaluated) -> None:
    from evaluation.checkpoint import load_checkpoint_for_inference

    loaded = load_checkpoint_for_inference(checkpoint, device="cpu")
    tokenizer, model = loaded.tokenizer, loaded.model
    window = model.cfg.seq_len
    samples = _samples(evaluated["written"][0], "tiny_rolling")
    for sample, doc in zip(samples, ROLLING_DOCS):
        tokens = tokenizer.encode(doc["text"], add_special_tokens=False)
        stream = [tokenizer.eos_token_id] + tokens  # stream[i] precedes tokens[i]
        expected = 0.0
        for start in range(0, len(tokens), window):  # disjoint prediction windows
            end = min(start + window, len(tokens))
            inputs = stream[max(0, end - window):end]
            with torch.no_grad():
                log_probs = torch.log_softmax(model(torch.tensor([inputs])).double(), -1)[0]
            positions = range(len(inputs) - (end - start), len(inputs))
            expected += sum(float(log_probs[p, tokens[start + i]]) for i, p in enumerate(positions))
        assert sample["resps"][0][0] == pytest.approx(expected, abs=1e-3)
    assert len(tokenizer.encode(ROLLING_DOCS[1]["text"])) > window  # the second needs 2 windows


def test_results_file_sits_next_to_the_checkpoint(checkpoint: Path, evaluated) -> None:
    (results_file,) = evaluated["written"]
    assert results_file.parent == checkpoint and results_file.name.startswith("eval-")
    record = json.loads(results_file.read_text())
    assert record["step"] == 60 and record["run_name"] == "tiny_eval"
    assert record["n-samples"]["tiny_choice"]["effective"] == len(DOCS)
    assert {"eval/tiny_choice/acc", "eval/tiny_choice/acc_stderr", "eval/tiny_gen/exact_match",
            "eval/tiny_rolling/word_perplexity", "eval/tiny_rolling/bits_per_byte"} <= set(record["metrics"])
    assert record["eval_config"]["batch_size"] == 2
    summary = json.loads(evaluated["proc"].stdout.strip().splitlines()[-1])
    assert summary["results"] == str(results_file) and summary["wandb"] is None  # the run logged none


def test_hub_task_offline_fails_naming_the_offline_route(checkpoint: Path, tmp_path: Path) -> None:
    # PIQA's own hub dataset, as lm-eval's built-in piqa task loads it (without indexing the
    # ~15k built-in task files, which alone takes longer than this whole file).
    write_choice_task(tmp_path / "tasks", "hub_piqa", "dataset_path: baber/piqa\nvalidation_split: validation\n")
    proc = _evaluate_cli([f"checkpoint={checkpoint}", "tasks=hub_piqa", "device=cpu",
                          f"include_path={tmp_path / 'tasks'}"], tmp_path)
    assert proc.returncode == 2
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("error: ") and "hub_piqa" in message and "baber/piqa" in message
    assert "include_path=" in message and "dataset_path: json" in message  # route 1: a custom task
    assert "HF_DATASETS_OFFLINE=1" in message  # route 2: a pre-filled cache
    assert "Traceback" not in proc.stderr
    assert not list(checkpoint.glob("eval-*hub*"))


@pytest.mark.slow
def test_builtin_hub_task_offline_fails_naming_the_offline_route(checkpoint: Path, tmp_path: Path) -> None:
    proc = _evaluate_cli([f"checkpoint={checkpoint}", "tasks=piqa", "device=cpu"], tmp_path)
    assert proc.returncode == 2
    assert "Offline routes" in proc.stderr and "include_path=" in proc.stderr


def test_presets_expand_and_metrics_flatten() -> None:
    from evaluation.harness import downstream_metrics, expand_task_names

    paper = expand_task_names("paper")
    assert paper[:5] == ["lambada_openai", "piqa", "arc_easy", "arc_challenge", "hellaswag"]
    assert {"boolq", "cb", "copa", "multirc", "record", "sglue_rte", "wic", "wsc", "mmlu"} <= set(paper)
    assert expand_task_names("piqa, superglue,boolq")[:3] == ["piqa", "boolq", "cb"]
    assert len(expand_task_names("paper,superglue")) == len(paper)
    results = {"results": {"lambada_openai": {"alias": "lambada_openai", "perplexity,none": 12.5,
                                              "acc,none": 0.25, "acc_stderr,none": "N/A"},
                           "gsm8k": {"exact_match,strict-match": 0.5}}}
    assert downstream_metrics(results) == {"eval/lambada_openai/perplexity": 12.5,
                                           "eval/lambada_openai/acc": 0.25,
                                           "eval/gsm8k/exact_match_strict-match": 0.5}


def test_in_loop_evaluation_leaves_training_state_alone(checkpoint: Path, tmp_path: Path,
                                                         monkeypatch) -> None:
    import random

    import numpy as np

    from evaluation.checkpoint import load_checkpoint_for_inference
    from evaluation.in_loop import downstream_eval_metrics

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_choice_task(tmp_path / "tasks", "tiny_loop",
                      _local_json_dataset(tmp_path / "loop.jsonl", DOCS[:4], tmp_path / "hf_datasets"))
    loaded = load_checkpoint_for_inference(checkpoint, device="cpu")
    model = loaded.model.train()
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    expected_draws = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    metrics = downstream_eval_metrics(model, loaded.tokenizer, "tiny_loop", limit=3,
                                      include_path=str(tmp_path / "tasks"))
    assert torch.equal(torch.rand(3), expected_draws[0])
    assert (random.random(), np.random.rand()) == expected_draws[1:]
    assert model.training
    ours = [max(range(len(d["choices"])), key=lambda c: _our_continuation_logprob(
        model, loaded.tokenizer, d["question"], " " + d["choices"][c])) == d["label"] for d in DOCS[:3]]
    assert metrics["eval/tiny_loop/acc"] == pytest.approx(sum(ours) / 3)  # the first 3 documents


def test_wandb_logs_into_the_training_run(tmp_path: Path, monkeypatch) -> None:
    from evaluation.harness import log_to_wandb, wandb_mode_for_run

    assert wandb_mode_for_run("auto", {"logger": {"wandb": "disabled"}}) == "disabled"
    assert wandb_mode_for_run("offline", {"logger": {"wandb": "disabled"}}) == "offline"
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    from core.wandb_run import ensure_run_id

    trained_id = ensure_run_id(tmp_path)  # what the trainer stored in the run folder
    run_id = log_to_wandb({"eval/piqa/acc": 0.625}, run_name="llama500m/scape99", step=300,
                          run_config={"logger": {"project": "scape-sdp", "wandb": "auto"}},
                          mode="offline", resume_run=True, run_dir=tmp_path)
    assert run_id == trained_id, "evaluation logs into the run folder's wandb run, not one named after it"
    import wandb

    # finish() returns before wandb's service process has closed the run's transaction log;
    # teardown waits for that process to exit, so the file below is complete (CI saw it empty).
    wandb.teardown()
    from tests.wandb_files import offline_runs

    (run,) = offline_runs(tmp_path)
    assert run.run_id == trained_id and run.job_type == "eval"
    assert run.history[-1]["eval/piqa/acc"] == 0.625 and run.history[-1]["eval/step"] == 300
