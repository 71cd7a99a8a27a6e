"""The ``nxd-hf`` command / ``python -m nxd_hf``: subcommands, versions and backends for bug reports."""

import subprocess
import sys

import torch
import transformers

from nxd_hf import cli


def test_help_lists_subcommands_and_the_environment():
    result = subprocess.run([sys.executable, "-m", "nxd_hf", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for word in ("consolidate", "check", "env", f"torch {torch.__version__}",
                 f"transformers {transformers.__version__}", "peft ", "backend nxd_hf would use: gloo"):
        assert word in result.stdout, (word, result.stdout)


def test_env_subcommand_and_bad_input_exit_codes(capsys, tmp_path):
    assert cli.main(["env"]) == 0
    assert f"torch {torch.__version__}" in capsys.readouterr().out
    assert cli.main(["consolidate", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2  # a ValueError, said on stderr
    assert "error" in capsys.readouterr().err
