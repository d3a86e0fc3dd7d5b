"""Helpers the tests share (fixtures are in conftest.py)."""
import subprocess
import sys

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3", "gemma3", "qwen3moe"]  # the tiny random checkpoints conftest's ckpt makes


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`exactspec ARGS...` in a subprocess, as a user runs it (its output captured as text)."""
    return subprocess.run([sys.executable, "-m", "exactspec.cli", *args], capture_output=True, text=True, timeout=300)
