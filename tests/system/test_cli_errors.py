"""Bad input through the CLI: one line naming the problem and the fix, exit 1, no
traceback, nothing half-written."""

from __future__ import annotations

import json

import pytest

from tests.conftest import edit_json, make_hf_checkpoint


def assert_clean_error(code: int, err: str, *needles: str, exit_code: int = 1) -> None:
    """One line, no traceback, exit 1 (2: argparse's refusal of the command line)."""
    assert code == exit_code, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_shard(hf_dir, copy_dir, tmp_path, run_cli):
    ck = copy_dir(hf_dir("qwen3_moe"))
    (ck / "model.safetensors").rename(ck / "model-00001-of-00002.safetensors")
    index = {
        "metadata": {},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        },
    }
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    code, _, err = run_cli("convert", ck, tmp_path / "v")
    assert_clean_error(code, err, "model-00002-of-00002.safetensors", "download")
    assert not (tmp_path / "v").exists()


def test_truncated_shard(hf_dir, copy_dir, tmp_path, run_cli):
    ck = copy_dir(hf_dir("qwen3_moe"))
    shard = ck / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    code, _, err = run_cli("convert", ck, tmp_path / "v")
    assert_clean_error(code, err, "truncated", "download it again")


def test_config_contradicts_tensors(hf_dir, copy_dir, tmp_path, run_cli):
    ck = copy_dir(hf_dir("qwen3_moe"))
    edit_json(ck / "config.json", num_local_experts=16)  # the tensors hold 8
    code, _, err = run_cli("convert", ck, tmp_path / "v")
    assert_clean_error(code, err, "contradicts")
    ck2 = copy_dir(hf_dir("mixtral"), "ck2")
    edit_json(ck2 / "config.json", hidden_size=128)
    code, _, err = run_cli("convert", ck2, tmp_path / "v")
    assert_clean_error(code, err, "contradicts")


def test_unknown_model_type(hf_dir, copy_dir, tmp_path, run_cli):
    ck = copy_dir(hf_dir("olmoe"))
    edit_json(ck / "config.json", model_type="frobnicator_moe")
    code, _, err = run_cli("convert", ck, tmp_path / "v")
    assert_clean_error(code, err, "frobnicator_moe", "qwen3_moe")


def test_dense_model_is_refused(tmp_path, run_cli):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    code, _, err = run_cli("convert", tmp_path / "llama", tmp_path / "v")
    assert_clean_error(code, err, "dense", "mlx-lm")


def test_not_a_checkpoint(tmp_path, run_cli):
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli("convert", tmp_path / "empty", tmp_path / "v")
    assert_clean_error(code, err, "config.json")
    code, _, err = run_cli("convert", tmp_path / "nowhere", tmp_path / "v")
    assert_clean_error(code, err, "not a directory")


def test_broken_config_json(hf_dir, copy_dir, tmp_path, run_cli):
    ck = copy_dir(hf_dir("olmoe"))
    (ck / "config.json").write_text("{not json")
    code, _, err = run_cli("convert", ck, tmp_path / "v")
    assert_clean_error(code, err, "config.json", "not valid JSON")


def test_existing_target(hf_dir, tmp_path, run_cli):
    assert run_cli("convert", hf_dir("olmoe"), tmp_path / "v", "--quiet")[0] == 0
    code, _, err = run_cli("convert", hf_dir("olmoe"), tmp_path / "v", "--quiet")
    assert_clean_error(code, err, "--force")
    code, out, _ = run_cli("convert", hf_dir("olmoe"), tmp_path / "v", "--quiet", "--force")
    assert code == 0 and "MB/s of source" in out


def test_group_size_and_expert_shapes(tmp_path, run_cli):
    src = make_hf_checkpoint(tmp_path / "ck", "qwen3_moe", moe_intermediate_size=32)
    code, _, err = run_cli("convert", src, tmp_path / "v", "--quiet", "--group-size", "64")
    assert_clean_error(code, err, "group size", "--group-size")
    assert not (tmp_path / "v").exists()
    # Unasked, the group size falls back to one that fits 32-wide experts.
    assert run_cli("convert", src, tmp_path / "v", "--quiet")[0] == 0
    manifest = json.loads((tmp_path / "v" / "manifest.json").read_text())
    assert manifest["quantization"]["experts"]["group_size"] == 32


@pytest.mark.parametrize("what", ["no manifest", "bad version", "truncated"])
def test_inspect_bad_vault(what, hf_dir, tmp_path, run_cli):
    assert run_cli("convert", hf_dir("olmoe"), tmp_path / "v", "--quiet")[0] == 0
    v = tmp_path / "v"
    if what == "no manifest":
        (v / "manifest.json").unlink()
        needle = "not a vault"
    elif what == "bad version":
        edit_json(v / "manifest.json", version=99)
        needle = "version 99"
    else:
        with open(v / "experts.bin", "r+b") as f:
            f.truncate(16384)
        needle = "experts.bin"
    code, _, err = run_cli("inspect", v)
    assert_clean_error(code, err, needle)


def test_cli_subprocess_has_no_traceback(tmp_path):
    """The installed console entry point, end to end."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "smoe.cli", "inspect", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and "not a directory" in r.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--preset", "nope"], "unknown trace preset 'nope'"),
        (["--preset", "qwen3-30b-like", "--set", "bogus=1"], "'bogus' does not exist"),
        (["--preset", "qwen3-30b-like", "--set", "keep=abc"], "give FIELD=NUMBER"),
        (["--preset", "qwen3-30b-like", "--set", "top_k=0"], "0 < top_k <= num_experts"),
        (["--preset", "qwen3-30b-like", "--policies", "bogus"], "unknown policies ['bogus']"),
        (["/nonexistent.npz"], "cannot read routing archive"),
        ([], "give an archive or --preset"),
    ],
)
def test_bench_policy_bad_input(run_cli, capsys, args, needle):
    usage = 1
    try:
        code, _, err = run_cli("bench", "policy", *args)
    except SystemExit as e:  # argparse's own errors: usage line, then the error line
        code, err, usage = int(e.code or 0), capsys.readouterr().err.splitlines()[-1], 2
    assert_clean_error(code, err, needle, exit_code=usage)


def test_bench_policy_help_names_the_command(run_cli, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_cli("bench", "policy", "--help")
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: smoe bench policy")


def test_an_unknown_option_is_refused(run_cli):
    with pytest.raises(SystemExit) as exit_:
        run_cli("generate", "V", "--bogus")
    assert exit_.value.code == 2


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["chat", "--top-p", "2"], "--top-p"),
        (["chat", "--temp", "-1"], "--temp"),
        (["chat", "--max-tokens", "0"], "--max-tokens must be at least 1"),
        (["serve", "--top-p", "0"], "--top-p"),
        (["serve", "--max-tokens", "0"], "--max-tokens must be at least 1"),
    ],
)
def test_sampling_flags_no_reply_could_use_are_refused_at_start(run_cli, argv, needle):
    """Before loading (not at every turn, as `chat --top-p 2` was): one line, exit 1."""
    code, _, err = run_cli(*argv)
    assert_clean_error(code, err, needle)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["serve", "--port", "70000"], "--port 70000 is not a TCP port"),  # served on 4464
        (["serve", "--port", "-1"], "--port -1 is not a TCP port"),
        (["serve", "--api-key", ""], "--api-key is empty"),  # silently asked no key
        (["serve", "--api-key", "  "], "--api-key is empty"),
        (["serve", "--api-key-file", "/nonexistent/key"], "cannot read --api-key-file"),
        (["serve", "--api-key-file", "/dev/null"], "--api-key-file /dev/null is empty"),
        (["serve", "--idle-timeout", "0"], "--idle-timeout must be above 0"),
        (["serve", "--max-connections", "0"], "--max-connections at least 1"),
        (["serve", "--prefix-cache-dir", "/etc/hostname"], "is a file; name a directory"),
        (["serve", "--request-memory", "1MB"], "--request-memory must be at least"),
    ],
)
def test_serve_refuses_what_would_silently_change(run_cli, argv, needle):
    """Issue 30: before loading anything, one line, exit 1."""
    code, _, err = run_cli(*argv)
    assert_clean_error(code, err, needle)


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--request-memory", "lots"],
        ["serve", "--prefix-cache-disk", "lots"],
        ["serve", "--prefix-cache", "lots"],
        ["generate", "V", "--prompt-ids", "1", "--memory", "lots"],
        ["chat", "--host-memory", "lots"],
        ["plan", "V", "--memory", "lots"],
    ],
)
def test_a_size_that_cannot_be_read_is_a_usage_error(run_cli, capsys, argv):
    """Every size flag is read once, by argparse (issue 52): its usage and one error line
    naming the flag and how to write a size, exit 2, before anything else is looked at."""
    with pytest.raises(SystemExit) as exit_:
        run_cli(*argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(f"usage: smoe {argv[0]} ")
    flag = argv[-2]
    assert err.splitlines()[-1] == (
        f"smoe {argv[0]}: error: argument {flag}: cannot read size 'lots'; write it like "
        "6GB, 512MB or 1.5GiB"
    )


def test_a_port_in_use_is_one_line_before_loading(run_cli):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = run_cli("serve", "--port", port)  # the demo: refused before it loads
    assert_clean_error(code, err, f"port {port} on 127.0.0.1 is in use")
    assert "give another --port" in err


def test_version_names_smoe_and_mlx(run_cli, capsys):
    with pytest.raises(SystemExit) as done:
        run_cli("--version")
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith("smoe 0.1.0 (mlx ") and "mlx-lm " in out


def test_an_error_under_json_is_json_on_stdout_too(run_cli, tmp_path):
    """With --json, a script reads the error as JSON on stdout; the line stays on stderr."""
    code, out, err = run_cli("generate", tmp_path / "nothing", "--prompt-ids", "5", "--json")
    assert_clean_error(code, err, "nothing")
    got = json.loads(out)
    assert got["exit_code"] == 1 and "nothing" in got["error"] and got["type"].endswith("Error")
