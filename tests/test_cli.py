"""The `pdserve generate` command, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _pdserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_generate_chat_streams_text_and_reports_latency():
    r = _pdserve("generate", "--chat", "What is the capital of France?", "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "TTFT" in r.stderr and "mean ITL" in r.stderr and "tokens/s" in r.stderr
    assert "SmolLM2-135M-Instruct" in r.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", "hi", "--top-p", "2"], "top_p"),
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature"),
    ],
)
def test_bad_arguments_exit_2_naming_the_field(args, message):
    r = _pdserve("generate", *args)
    assert r.returncode == 2 and message in r.stderr


def test_serve_with_an_unloadable_model_fails_in_one_line_before_ray_starts(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf")
    for model, says in (("/nonexistent/x.gguf", "does not exist"), (str(bad), "x.gguf")):
        r = _pdserve("serve", "--model", model)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("pdserve: cannot load the model:")
        assert says in lines[0] and "ray" not in r.stderr.lower()


def test_missing_model_exits_1():
    r = _pdserve("generate", "--prompt", "hi", "--model", "/nonexistent/x.gguf")
    assert r.returncode == 1 and "does not exist" in r.stderr


def test_version_flag(capsys):
    from services.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == "pdserve 0.1.0"
