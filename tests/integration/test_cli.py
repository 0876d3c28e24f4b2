"""The `svip generate` command: JSON output, batches, samples, and a one-line error (never a
traceback) for each kind of bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from svip_cli.main import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def pair_args(model_dirs, draft=None) -> list[str]:
    return ["--target", model_dirs.target, "--draft", draft or model_dirs.close_draft]


def test_structured_output_from_the_command_line(capsys, model_dirs, tmp_path):
    """--json-schema (a file or the schema), --regex: the output follows it and equals the target
    alone's with the same grammar; a grammar that does not compile, or two, is a one-line error."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    for grammar in (["--json-schema", str(path)], ["--json-schema", json.dumps(schema)], ["--regex", "[a-z]{2,5}"]):
        outputs = []
        for draft in (model_dirs.close_draft, "none"):
            code, out, err = run_cli(capsys, "generate", "def", *pair_args(model_dirs, draft), *grammar,
                                     "--max-new-tokens", "40", "--json")
            assert code == 0, err
            outputs.append(json.loads(out))
        assert outputs[0]["token_ids"] == outputs[1]["token_ids"] and outputs[0]["finish_reason"] == "stop"
        if grammar[0] == "--json-schema":
            assert json.loads(outputs[0]["text"]) in ({"ok": True}, {"ok": False})
    for bad, words in ((["--regex", "[a-"], "the regex does not compile"),
                       (["--regex", "a", "--json-object"], "at most one of --json-object")):
        code, _, err = run_cli(capsys, "generate", "def", *pair_args(model_dirs), *bad)
        assert code == 2 and words in err and err.count("\n") == 1, err


def test_generate_json(capsys, model_dirs, models):
    code, out, err = run_cli(
        capsys, "generate", "def fibonacci(n):", *pair_args(model_dirs), "--max-new-tokens", "12", "--json"
    )
    assert code == 0, err
    record = json.loads(out)
    assert set(record) >= {"text", "token_ids", "prompt_token_ids", "stats", "finish_reason"}
    stats = record["stats"]
    for key in ("rounds", "draft_tokens", "accepted_tokens", "draft_lengths", "accepted_lengths",
                "target_forwards", "draft_forwards", "wall_s", "config"):
        assert key in stats
    assert len(record["token_ids"]) == 12
    assert len(stats["draft_lengths"]) == len(stats["accepted_lengths"]) == stats["rounds"]
    assert stats["config"]["policy"]["name"] == "auto"  # the default policy
    assert record["text"] == models["target"].tokenizer.decode(record["token_ids"], skip_special_tokens=True)
    assert record["prompt_token_ids"] == models["target"].tokenizer("def fibonacci(n):")["input_ids"]


def test_plain_output_is_the_text(capsys, model_dirs):
    code, out, _ = run_cli(capsys, "generate", "def", *pair_args(model_dirs), "--max-new-tokens", "5")
    code_json, out_json, _ = run_cli(
        capsys, "generate", "def", *pair_args(model_dirs), "--max-new-tokens", "5", "--json"
    )
    assert code == code_json == 0
    assert out == json.loads(out_json)["text"] + "\n"


def test_draft_none_equals_speculative_greedy(capsys, model_dirs):
    outputs = []
    for draft, policy in ((model_dirs.close_draft, "svip"), ("none", "svip"), (model_dirs.random_draft, "heuristic")):
        code, out, err = run_cli(
            capsys,
            "generate",
            "--prompt-ids",
            "5,6,7,8",
            *pair_args(model_dirs, draft),
            "--policy",
            policy,
            "--max-new-tokens",
            "20",
            "--json",
        )
        assert code == 0, err
        outputs.append(json.loads(out)["token_ids"])
    assert outputs[0] == outputs[1] == outputs[2]


def test_a_tree_from_the_command_line_equals_the_target_alone(capsys, model_dirs):
    """`--tree cape`: each block a token tree; the output is the target's own, and --json says
    how many nodes were verified and how many rounds a sibling settled one token more."""
    outputs, stats = [], []
    for draft, tree in ((model_dirs.close_draft, "cape"), (model_dirs.close_draft, "auto"), ("none", "off")):
        code, out, err = run_cli(capsys, "generate", "--prompt-ids", "5,6,7,8", *pair_args(model_dirs, draft),
                                 "--policy", "constant", "--draft-length", "3", "--tree", tree,
                                 "--max-new-tokens", "24", "--json")
        assert code == 0, err
        record = json.loads(out)
        outputs.append(record["token_ids"])
        stats.append(record["stats"])
    assert outputs[0] == outputs[1] == outputs[2]
    assert stats[0]["tree_nodes"] > stats[0]["draft_tokens"] and stats[0]["config"]["policy"]["tree"] == "cape"
    assert stats[2]["tree_nodes"] == 0


def test_batch_input_keeps_order(capsys, model_dirs, tmp_path):
    batch = tmp_path / "batch.jsonl"
    batch.write_text('{"prompt": "def"}\n\n{"prompt_ids": [5, 6, 7]}\n{"prompt": "import os"}\n')
    code, out, err = run_cli(
        capsys, "generate", "--input", str(batch), *pair_args(model_dirs), "--max-new-tokens", "4", "--json"
    )
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert len(records) == 3
    assert records[1]["prompt_token_ids"] == [5, 6, 7]
    single = run_cli(
        capsys, "generate", "--prompt-ids", "5,6,7", *pair_args(model_dirs), "--max-new-tokens", "4", "--json"
    )
    assert json.loads(single[1])["token_ids"] == records[1]["token_ids"]


@pytest.mark.parametrize("load_aware", ["greedy", "off"])
def test_batch_size_runs_the_file_at_once_with_the_same_outputs_in_order(capsys, model_dirs, tmp_path, load_aware):
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(f'{{"prompt_ids": [5, 6, {7 + i}]}}\n' for i in range(6)) + '{"prompt": "def"}\n')
    args = [
        "generate",
        "--input",
        str(batch),
        *pair_args(model_dirs),
        "--max-new-tokens",
        "12",
        "--json",
        "--load-aware",
        load_aware,
    ]
    code, one, err = run_cli(capsys, *args, "--batch-size", "1")
    assert code == 0, err
    code, many, err = run_cli(
        capsys, *args, "--batch-size", "4", "--kv-cache-tokens", "256", "--max-batched-tokens", "64"
    )
    assert code == 0, err
    ids = lambda out: [(r["prompt_token_ids"], r["token_ids"]) for r in map(json.loads, out.splitlines())]  # noqa: E731
    assert ids(many) == ids(one) and len(ids(one)) == 7


def test_n_samples_are_seeded_from_seed_and_index(capsys, model_dirs):
    args = ["generate", "def", *pair_args(model_dirs), "--max-new-tokens", "16", "--temperature", "1", "--json"]
    code, out, _ = run_cli(capsys, *args, "--n", "3", "--seed", "10")
    assert code == 0
    samples = [json.loads(line) for line in out.splitlines()]
    assert [s["stats"]["config"]["sampling"]["seed"] for s in samples] == [10, 11, 12]
    assert len({tuple(s["token_ids"]) for s in samples}) > 1
    _, again, _ = run_cli(capsys, *args, "--seed", "11")
    assert json.loads(again)["token_ids"] == samples[1]["token_ids"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt-ids", "1,x,3"], "--prompt-ids: 'x' is not an integer"),
        (["--prompt-ids", "1,99999"], "prompt token id 99999 is outside the vocabulary"),
        (["--prompt-ids", "1,-4"], "prompt token id -4 is outside the vocabulary"),
        (
            [
                "",
            ],
            "prompt is empty",
        ),
        (["x", "--max-new-tokens", "0"], "max_new_tokens must be in [1, 2^31), got 0"),
        (["x", "--max-new-tokens", "-3"], "max_new_tokens must be in [1, 2^31), got -3"),
        (["x", "--temperature", "-0.5"], "temperature must be a number >= 0"),
        (["x", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["x", "--top-p", "1.2"], "top_p must be in (0, 1]"),
        (["x", "--policy", "fastest"], "--policy: must be one of auto, svip, constant, heuristic, confidence, none"),
        (["x", "--threshold", "-1"], "--threshold: must be a number >= 0 or 'auto', got -1.0"),
        (["x", "--threshold", "high"], "--threshold: must be a number >= 0 or 'auto', got 'high'"),
        (["x", "--draft-length", "0"], "draft length must be in [1, 64], got 0"),
        (["x", "--max-new-tokens", "many"], "invalid int value: 'many'"),
        (["x", "--n", "0"], "--n must be >= 1"),
        (["x", "--tree", "deepest"], "--tree: must be one of off, cape, auto, deep, deep-auto, got 'deepest'"),
        (["x", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["x", "--kv-cache-tokens", "16", "--max-new-tokens", "40"], "does not fit the KV cache of 16 tokens"),
        (["x", "--load-aware", "sometimes"], "--load-aware: must be one of off, greedy, all, got 'sometimes'"),
        (["x", "--mode", "distributed", "--idle-prefill", "eager"], "--idle-prefill: must be one of auto, always, off"),
        (["x", "--mode", "distributed", "--target-gpus", "0"], "--target-gpus: must be an integer in [1, 8], got 0"),
        (["x", "--max-new-tokens", "600"], "exceeds the model's context of 512 tokens"),
        (["x", "--prompt-ids", "1"], "give exactly one prompt source"),
        ([], "give exactly one prompt source"),
        (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read prompt file"),
        (["--input", "/nonexistent/batch.jsonl"], "cannot read input file"),
    ],
)
def test_bad_input_gets_one_line_error(capsys, model_dirs, extra, message):
    code, out, err = run_cli(capsys, "generate", *extra, *pair_args(model_dirs))
    assert code == 2
    assert out == ""
    assert err.startswith("svip: error: ") and err.count("\n") == 1
    assert message in err


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"prompt": "ok"}\n{"prompt": \n', "batch.jsonl:2: not valid JSON"),
        (b'{"prompt": 3}\n', '"prompt" must be a string'),
        (b'{"prompt_ids": [1, "a"]}\n', '"prompt_ids" must be a list of integers'),
        (b'{"text": "hi"}\n', 'exactly one of "prompt", "prompt_ids"'),
        (b"\n\n", "holds no prompts"),
        (b'{"prompt": "\xff"}\n', "is not valid UTF-8"),
    ],
)
def test_malformed_input_file(capsys, model_dirs, tmp_path, content, message):
    path = tmp_path / "batch.jsonl"
    path.write_bytes(content)
    code, _, err = run_cli(capsys, "generate", "--input", str(path), *pair_args(model_dirs))
    assert code == 2 and message in err and err.count("\n") == 1


def test_non_utf8_prompt_file(capsys, model_dirs, tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_bytes(b"caf\xe9")
    code, _, err = run_cli(capsys, "generate", "--prompt-file", str(path), *pair_args(model_dirs))
    assert code == 2 and "is not valid UTF-8" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--target", "/nonexistent/model", "--draft", "none"], "no model directory at '/nonexistent/model'"),
        (["--target", "TARGET"], "a target needs a draft"),
    ],
)
def test_model_errors(capsys, model_dirs, tmp_path, args, message):
    args = [model_dirs.target if a == "TARGET" else a for a in args]
    code, _, err = run_cli(capsys, "generate", "x", *args)
    assert code in (1, 2) and message in err and err.count("\n") == 1


def test_not_a_model_directory(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "x", "--target", str(tmp_path), "--draft", "none")
    assert code == 1 and "is not a Hugging Face model directory" in err


def test_mismatched_vocabularies(capsys, model_dirs, tmp_path):
    from tests.tiny_models import build_model, build_tokenizer, save_model

    tok = build_tokenizer(vocab_size=300)
    other = save_model(tmp_path / "other", tok, build_model(tok, seed=9, hidden=32, layers=1))
    code, _, err = run_cli(capsys, "generate", "x", "--target", model_dirs.target, "--draft", other)
    assert code == 1 and "does not share the vocabulary" in err


def test_console_script_non_utf8_argv_and_no_traceback(model_dirs):
    """Through the real process boundary: bytes that are not UTF-8 on the command line."""
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run(
        [sys.executable, "-m", "svip_cli", "generate", b"caf\xe9", *pair_args(model_dirs)],
        capture_output=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 2
    assert proc.stderr.decode().strip() == "svip: error: prompt is not valid UTF-8"
    assert b"Traceback" not in proc.stderr


@pytest.mark.system
def test_distributed_mode_from_the_command_line(model_dirs, capsys):
    """`--mode distributed` starts Ray and both worker actors on loopback, and prints the same
    tokens as the in-process engine, with the pipeline's own stats (the target prefilling while
    it waits, --idle-prefill always, changes no token)."""
    args = ["generate", "--prompt-ids", "5,6,7,8", *pair_args(model_dirs), "--max-new-tokens", "16", "--json"]
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run(
        [sys.executable, "-m", "svip_cli", *args, "--mode", "distributed", "--pipeline", "async",
         "--idle-prefill", "always", "--draft-parallel", "2",
         "--emulate", "target=llama-3.2-1b@h100,draft=qwen2.5-0.5b@h100"],
        capture_output=True,
        env=env,
        cwd=REPO,
        timeout=300,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    distributed = json.loads(proc.stdout)
    code, out, _ = run_cli(capsys, *args)
    assert code == 0
    assert distributed["token_ids"] == json.loads(out)["token_ids"]
    stats = distributed["stats"]
    assert stats["config"]["mode"] == "distributed" and stats["config"]["pipeline"] == "async"
    assert stats["config"]["idle_prefill"] == "always" and json.loads(out)["stats"]["config"]["idle_prefill"] is None
    assert stats["config"]["draft_parallel"] == 2 and json.loads(out)["stats"]["config"]["draft_parallel"] is None
    assert stats["wire_bytes"] > 0 and "discarded_tokens" in stats and stats["timeline"]
    for role, model in (("target", "llama-3.2-1b@h100"), ("draft", "qwen2.5-0.5b@h100")):  # a device each
        assert f"{role} as {model}: " in proc.stderr, proc.stderr[-2000:]


def test_emulated_devices_change_when_forwards_end_never_the_tokens(capsys, model_dirs):
    """`--emulate`: in process, the target's and the draft's forwards take turns on one emulated
    device and last their step models' time; the tokens are the same, the device's use is reported
    on stderr, the spec in the JSON; a bad spec is a one-line error before any model loads."""
    args = ["generate", "--prompt-ids", "5,6,7,8", *pair_args(model_dirs), "--max-new-tokens", "16", "--json"]
    code, plain, _ = run_cli(capsys, *args)
    spec = "target=llama-3.2-1b@h100,draft=qwen2.5-0.5b@h100,scale=2"
    code_emulated, emulated, err = run_cli(capsys, *args, "--emulate", spec)
    assert code == code_emulated == 0, err
    assert json.loads(emulated)["token_ids"] == json.loads(plain)["token_ids"]
    assert json.loads(emulated)["stats"]["config"]["emulate"] == spec
    assert f"svip: device timing ({spec}): device as llama-3.2-1b@h100: " in err and " forwards" in err
    sampled = [*args, "--temperature", "0.8", "--top-p", "0.9", "--seed", "7"]  # a seed draws the same tokens
    runs = [run_cli(capsys, *sampled, *extra) for extra in ([], ["--emulate", spec])]
    assert [code for code, _, _ in runs] == [0, 0]
    assert json.loads(runs[0][1])["token_ids"] == json.loads(runs[1][1])["token_ids"]
    code, _, err = run_cli(capsys, *args, "--emulate", "target=llama-3.1-8b@tpu")
    assert code == 2 and "unknown device 'tpu'; known: h100, h200" in err and err.count("\n") == 1


def test_a_feature_heads_steps_are_timed_too_and_its_tokens_unchanged(capsys):
    """--emulate with the embedded target's feature head: the head has no KV pool, its step is timed
    as a whole on the shared device; the tokens are the same as without."""
    args = ["generate", "--prompt-ids", "5,6,7,8", "--draft", "eagle", "--max-new-tokens", "16", "--json"]
    code, plain, _ = run_cli(capsys, *args)
    code_emulated, emulated, err = run_cli(capsys, *args, "--emulate",
                                           "target=llama-3.1-8b@h100,draft=eagle3-llama-3.1-8b@h100")
    assert code == code_emulated == 0, err
    assert json.loads(emulated)["token_ids"] == json.loads(plain)["token_ids"]
    forwards = int(re.search(r"device as llama-3\.1-8b@h100: (?:\d+ of )?(\d+) forwards", err)[1])
    stats = json.loads(emulated)["stats"]
    assert forwards >= stats["target_forwards"] + stats["draft_forwards"] > stats["target_forwards"]


@pytest.mark.parametrize("flag, value", [("--pipeline", "sync"), ("--idle-prefill", "off"), ("--draft-parallel", "2")])
def test_pipeline_settings_need_distributed_mode(capsys, model_dirs, flag, value):
    code, _, err = run_cli(capsys, "generate", "x", *pair_args(model_dirs), flag, value)
    assert code == 2 and f"{flag} applies to --mode distributed" in err


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--replicas", "0"], 2, "--replicas: must be an integer in [1, 1024], got 0"),
        (["--port", "70000"], 2, "--port: must be an integer in [1, 65535], got 70000"),
        (["--metrics-port", "52365"], 2, "--metrics-port 52365 is where Ray's dashboard agent listens"),
        (["--max-in-flight", "0"], 2, "--max-in-flight: must be an integer in [1, 4096], got 0"),
        (["--draft-parallel", "17"], 2, "--draft-parallel: must be an integer in [1, 16], got 17"),
        (["--policy", "fastest"], 2, "--policy: must be one of auto, svip"),
        (["--tool-call-parser", "mistral"], 2, "must be one of hermes, llama3_json, none, got 'mistral'"),
        (["--target", "/nonexistent", "--draft", "none"], 1, "no model directory at '/nonexistent'"),
        (["--draft", "/somewhere"], 1, "no model directory at '/somewhere'"),
        (["--target", "/somewhere", "--draft", "eagle"], 2, "draft 'eagle' is the embedded target's feature head"),
        (["--draft", "none", "--draft-kind", "eagle"], 2, "draft_kind 'eagle' needs a draft"),
        (["--target", "/t", "--draft", "/no/head", "--draft-kind", "eagle"], 1, "'/no/head': no such directory"),
        (["--emulate", "target=llama-3.1-8b@h100,draft=llama-3.2-1b@h100,link=slow"], 2, "unknown link 'slow'"),
        (["--emulate", "target=llama-3.1-8b@h100"], 2, "names no draft, and the pair has one"),
    ],
)
def test_serve_refuses_bad_settings_before_starting(capsys, args, code, message):
    import socket

    with socket.socket() as probe:  # a free port: the settings, not the port, must be refused
        probe.bind(("127.0.0.1", 0))
        free = str(probe.getsockname()[1])
    ports = [] if "--port" in args else ["--port", free, "--metrics-port", free]
    got, out, err = run_cli(capsys, "serve", *ports, *args)
    assert got == code and message in err and "Traceback" not in err, err
    assert err.count("\n") == 1


def test_serve_takes_the_embedded_targets_feature_head():
    """`svip serve --draft eagle`: the embedded target with its feature head, checked before Ray starts."""
    from svip_assets import default_head, default_pair
    from svip_serve.local import check_models
    from svip_serve.settings import ServeSettings

    settings = ServeSettings.from_args({"draft": "eagle"})
    assert settings.model_paths() == (default_pair()[0], default_head())
    check_models(settings)  # the head is no model: no vocabulary check against it, and no error


def test_serve_refuses_a_port_in_use(capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, _, err = run_cli(capsys, "serve", "--port", str(port))
    assert code == 1 and f"cannot listen on 127.0.0.1:{port}" in err


def test_serve_refuses_an_open_api_on_a_network_address(capsys, monkeypatch):
    """`svip serve --host 0.0.0.0` without a key started with one quiet line; now it is refused by
    name (before anything starts) unless --allow-open says so."""
    monkeypatch.delenv("SVIP_API_KEY", raising=False)
    code, _, err = run_cli(capsys, "serve", "--host", "0.0.0.0")
    assert code == 2 and "--host 0.0.0.0 faces the network and no API key is set" in err
    assert "--allow-open" in err


def test_a_tensor_parallel_target_from_the_command_line(capsys, model_dirs):
    """--target-tp 2 in process: rank 1 a thread of the CLI's process; the target alone's greedy
    output at degree 2 is speculation's; a degree the model does not divide, or past the bound, or one
    the emulated devices do not match, is a one-line error before any model loads."""
    outputs = []
    for draft in (model_dirs.close_draft, "none"):
        code, out, err = run_cli(capsys, "generate", "def fibonacci(n):", *pair_args(model_dirs, draft),
                                 "--target-tp", "2", "--policy", "svip", "--max-new-tokens", "24", "--json")
        assert code == 0, err
        outputs.append(json.loads(out)["token_ids"])
    code, out, err = run_cli(capsys, "generate", "def fibonacci(n):", *pair_args(model_dirs), "--target-tp", "2",
                             "--draft-tp", "2", "--policy", "svip", "--max-new-tokens", "24", "--json")
    assert code == 0 and json.loads(out)["token_ids"] == outputs[0], err  # the draft sharded too
    assert outputs[0] == outputs[1]
    for degree, words in (("3", "does not divide the model's 4 attention heads"),
                          ("9", "--target-tp: must be an integer in [1, 8]")):
        code, _, err = run_cli(capsys, "generate", "def", *pair_args(model_dirs), "--target-tp", degree)
        assert code == 2 and words in err and err.count("\n") == 1, err
    code, _, err = run_cli(capsys, "generate", "def", *pair_args(model_dirs), "--target-tp", "2", "--emulate",
                           "target=llama-3.1-70b@4xh100,draft=llama-3.1-8b@h100")
    assert code == 2 and "target_tp 2, but emulate times the target on 4 device(s)" in err
